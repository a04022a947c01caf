"""Host probes and the power/clock sampler (imports nothing from `appliance`).

Each probe (`probe_cpu`, `probe_memory`, `probe_kernel`, `probe_gpus`, `probe_iommu`,
`probe_power`) reads /proc, /sys and tools below a root path through an injected command
runner, and never raises: a fact it cannot read is `Unavailable(reason)`. `collect()` runs them
all into one `HostSnapshot`; `advice.check()` lists the settings known to cost performance;
`report.render()` prints. `Sampler` records power and clocks per measured phase;
`to_jsonable(sampler.summary())` is its JSON form.
"""
from .advice import Advice, check
from .facts import Unavailable, run_command, to_jsonable
from .report import as_json, render
from .sampler import PhaseStats, Sampler
from .snapshot import HostSnapshot, collect

__all__ = ["Advice", "HostSnapshot", "PhaseStats", "Sampler", "Unavailable", "as_json", "check",
           "collect", "render", "run_command", "to_jsonable"]
