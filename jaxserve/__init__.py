"""jaxserve: an inference server for Mixture-of-Experts LLMs on JAX/XLA.

`from jaxserve import LLM, SamplingParams` gives the offline API. `LLM` is imported
lazily (PEP 562) so that processes that never touch JAX (the frontend, the detokenizer)
can import `jaxserve.config` or `jaxserve.ipc` without loading JAX.
"""

from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
