"""The model library: GGUFs on disk under the appliance's models directory, pulled from the
Hugging Face Hub (`appliance pull`), listed (`appliance models`) and removed (`appliance rm`).

    refs.py      ORG/REPO[:QUANT] and the choice of a repository's GGUF files (split parts together,
                 the projector or MTP head beside a model)
    card.py      what a header says of a model: quant, arch, context, template, parameters
    index.py     Library: library.json under the models directory, and GGUFs found elsewhere
    hub.py       the Hub: file listing, ranged header reads, resumable checked downloads
    command.py   the three commands
"""
