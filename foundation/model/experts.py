"""Multi-domain, multi-task output: shared and per-domain experts, per-(domain, task) gates and heads.

Every row is routed by its own domain: its gate for task ``t`` mixes the shared experts with its
domain's experts, and its head for ``t`` reads that mixture. All experts run as two batched
matmuls (no per-domain loop, no host sync): experts are few and small next to the sequence arch,
so computing every domain's experts for every row is cheaper than gathering rows by domain.
"""

from __future__ import annotations

import torch
from torch import nn


class MultiDomainExperts(nn.Module):
    """``z[B, D_in]``, ``domain[B]`` -> ``logits[B, num_tasks]`` (each row through its own domain's gates and heads)."""

    def __init__(
        self,
        d_in: int,
        *,
        num_domains: int,
        num_tasks: int,
        num_shared: int,
        num_per_domain: int,
        hidden: int,
        expert_dim: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.num_domains, self.num_tasks = num_domains, num_tasks
        self.num_shared, self.num_per_domain = num_shared, num_per_domain
        self.num_experts = num_shared + num_domains * num_per_domain
        self.hidden, self.expert_dim = hidden, expert_dim
        self.first = nn.Linear(d_in, self.num_experts * hidden)
        self.second = nn.Parameter(torch.randn(self.num_experts, hidden, expert_dim) / hidden**0.5)
        self.second_bias = nn.Parameter(torch.zeros(self.num_experts, expert_dim))
        self.dropout = nn.Dropout(dropout)
        self.gates = nn.Linear(d_in, num_domains * num_tasks * (num_shared + num_per_domain))
        self.head_weight = nn.Parameter(torch.randn(num_domains, num_tasks, expert_dim) / expert_dim**0.5)
        self.head_bias = nn.Parameter(torch.zeros(num_domains, num_tasks))

    def run_experts(self, z: torch.Tensor) -> torch.Tensor:
        """``z[B, D_in]`` -> every expert's output ``[B, num_experts, expert_dim]`` (shared first, then by domain)."""
        hidden = self.dropout(nn.functional.silu(self.first(z))).view(-1, self.num_experts, self.hidden)
        return torch.einsum("beh,ehd->bed", hidden, self.second) + self.second_bias

    def select_domain_experts(self, outputs: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        """Keep the shared experts and the row's own domain experts: ``[B, num_shared + num_per_domain, e]``."""
        own = (
            self.num_shared
            + domain[:, None] * self.num_per_domain
            + torch.arange(self.num_per_domain, device=domain.device)
        )
        shared = torch.arange(self.num_shared, device=domain.device).expand(domain.numel(), -1)
        index = torch.cat([shared, own], dim=1)
        return outputs.gather(1, index[:, :, None].expand(-1, -1, self.expert_dim))

    def forward(self, z: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(z.shape[0], device=z.device)
        experts = self.select_domain_experts(self.run_experts(z), domain)  # [B, E_row, e]
        gate_logits = self.gates(z).view(-1, self.num_domains, self.num_tasks, experts.shape[1])[rows, domain]
        mixture = torch.einsum("bte,bed->btd", torch.softmax(gate_logits, dim=-1), experts)  # [B, T, e]
        return (mixture * self.head_weight[domain]).sum(-1) + self.head_bias[domain]
