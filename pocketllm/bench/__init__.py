"""The throughput and latency benchmark behind `pocketllm bench` (see `command` for what it measures).

It lives under `pocketllm` so that an installed `pocketllm bench` finds it, but nothing in the
engine imports it: `import pocketllm` never loads it. Modules by job: `workloads` (what is run
and what a run yields), `runners` (pocketllm runs and the run plan), `baseline` (transformers
runs), `report` (goals, JSON, Markdown), `plots` (PNG files), `command` (arguments, the whole run), and
`real_shapes` (`--real-shapes`: the published checkpoints' shapes against transformers) and
`scheduling` (`--scheduling`: prefix reuse and chunked prefill, on and off).
"""

from .command import main

__all__ = ["main"]
