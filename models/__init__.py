"""Small reference models used by the demo, the tests and the benchmarks."""
from .gpt import GPT, GPTConfig
from .mlp import MLP

__all__ = ["GPT", "GPTConfig", "MLP"]
