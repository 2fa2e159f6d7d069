"""tandem: an LLM inference server built around EAGLE speculative decoding with an overlap scheduler."""

from tandem.demo import demo_model_paths
from tandem.engine.engine import Engine
from tandem.named_models import model_paths
from tandem.request import RequestOutput, SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "demo_model_paths", "model_paths"]
__version__ = "0.1.0"
