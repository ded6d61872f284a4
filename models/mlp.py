import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 64, d_out: int = 8, depth: int = 2):
        super().__init__()
        dims = [d_in] + [d_hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)
