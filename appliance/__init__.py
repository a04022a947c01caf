"""appliance: a single-box LLM serving appliance for consumer hardware."""
__version__ = "0.1.0"
