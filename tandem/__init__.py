"""tandem: an LLM serving engine whose model state never gets lost, mixed up or read early."""
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from tandem.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
