"""Multi-domain, multi-task output: shared and per-domain experts, per-(domain, task) gates and heads.

Every row is routed by its own domain: its gate for task ``t`` mixes the shared experts with its
domain's experts, and its head for ``t`` reads that mixture. All experts run as two batched
matmuls (no per-domain loop, no host sync): experts are few and small next to the sequence arch,
so computing every domain's experts for every row is cheaper than gathering rows by domain.

The input is padded with zero columns to a multiple of :data:`INPUT_ALIGN`: a bf16 GEMM whose rows are not whole
16-byte vectors runs on cuBLAS's unaligned kernels, several times slower (docs/benchmarks.md), and the input here
is wide (the final interaction's tokens flattened, plus an odd count of pairwise dots). The two layers that read it
hold zero weights for the padding (drawn as the unpadded layers are, so the initial function is the same); their
gradient is zero, so AdamW leaves them zero.
"""

from __future__ import annotations

import torch
from torch import nn

# Input columns per whole 16-byte vector of a bf16 row.
INPUT_ALIGN = 8


def _with_zero_columns(weight: torch.Tensor, width: int) -> torch.Tensor:
    """``weight[out, in]`` with zero columns appended up to ``width``."""
    return torch.cat([weight, weight.new_zeros(weight.shape[0], width - weight.shape[1])], 1)


def _pad_input_columns(linear: nn.Linear, width: int) -> None:
    """Gives ``linear`` zero weight columns for inputs ``[in_features, width)``."""
    if width != linear.in_features:
        linear.weight = nn.Parameter(_with_zero_columns(linear.weight.detach(), width))
        linear.in_features = width


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
        self.d_in, self.padded_in = d_in, -(-d_in // INPUT_ALIGN) * INPUT_ALIGN
        self.first = nn.Linear(d_in, self.num_experts * hidden)
        self.second = nn.Parameter(torch.randn(self.num_experts, hidden, expert_dim) / hidden**0.5)
        self.second_bias = nn.Parameter(torch.zeros(self.num_experts, expert_dim))
        self.dropout = nn.Dropout(dropout)
        self.gates = nn.Linear(d_in, num_domains * num_tasks * (num_shared + num_per_domain))
        self.head_weight = nn.Parameter(torch.randn(num_domains, num_tasks, expert_dim) / expert_dim**0.5)
        self.head_bias = nn.Parameter(torch.zeros(num_domains, num_tasks))
        for linear in (self.first, self.gates):
            _pad_input_columns(linear, self.padded_in)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints from before the padding: their weights over the unpadded input get the zero columns.
        for name in ("first.weight", "gates.weight"):
            weight = state_dict.get(prefix + name)
            if weight is not None and weight.dim() == 2 and weight.shape[1] == self.d_in < self.padded_in:
                state_dict[prefix + name] = _with_zero_columns(weight, self.padded_in)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def run_experts(self, z: torch.Tensor) -> torch.Tensor:
        """``z[B, D_pad]`` (the padded input) -> every expert's output ``[B, num_experts, expert_dim]`` (shared first,
        then by domain)."""
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
        if z.shape[1] < self.padded_in:
            z = nn.functional.pad(z, (0, self.padded_in - z.shape[1]))
        rows = torch.arange(z.shape[0], device=z.device)
        experts = self.select_domain_experts(self.run_experts(z), domain)  # [B, E_row, e]
        gate_logits = self.gates(z).view(-1, self.num_domains, self.num_tasks, experts.shape[1])[rows, domain]
        mixture = torch.einsum("bte,bed->btd", torch.softmax(gate_logits, dim=-1), experts)  # [B, T, e]
        return (mixture * self.head_weight[domain]).sum(-1) + self.head_bias[domain]
