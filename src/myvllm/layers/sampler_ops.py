"""The Sampler's draw for rows that are not all greedy (layers/sampler.py): temperature,
min-p, top-k / top-p and the Gumbel-max draw; the top-k / top-p filter, also used by
speculative decoding's rejection sampler, the Exponential(1) noise of the draw, per-row
seeded, and the GPU's draw in Triton for a batch that needs neither filters nor seeds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from myvllm.kernels import use_triton
from myvllm.layers.logits_processors import apply_min_p


def sample_with_temperature(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor | None,
    top_ps: torch.Tensor | None, generators: Sequence[torch.Generator | None] | None,
    min_ps: torch.Tensor | None,
) -> torch.Tensor:
    """Sampler.forward of a batch that is not all greedy (its arguments as there): greedy rows
    (temperature 0) take their argmax, the others logits / temperature -> min-p -> top-k ->
    top-p -> argmax(p / E)."""
    if (top_ks is None and top_ps is None and min_ps is None and generators is None
            and use_triton(logits)):
        return gumbel_sample_gpu(logits, temperatures)  # kernels/sample_kernel.py

    greedy = logits.argmax(dim=-1)
    logits = logits.float()
    is_greedy = temperatures == 0
    # Greedy rows are replaced by `greedy` at the end; dividing them by 1 keeps them finite.
    temps = torch.where(is_greedy, torch.ones_like(temperatures), temperatures).float()
    logits = logits / temps.unsqueeze(-1)
    if min_ps is not None:
        logits = apply_min_p(logits, min_ps.float())
    if top_ks is not None or top_ps is not None:
        logits = top_k_top_p(logits, top_ks, top_ps)
    probs = torch.softmax(logits, dim=-1)
    sampled = (probs / exponential_noise(probs, generators)).argmax(dim=-1)
    return torch.where(is_greedy, greedy, sampled)


def top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
) -> torch.Tensor:
    """Set the logits outside each row's top-k / top-p set to -inf (one sort serves both).

    In the descending order, a token at rank r is kept when
        r < k                                 (top-k), and
        (mass of the tokens ranked before r) < p   (top-p: the smallest prefix reaching p)
    Rank 0 always survives, so top_k=1 or a tiny top_p leave exactly the argmax.
    """
    vocab = logits.shape[-1]
    # stable: among equal logits the lower id ranks first, like argmax.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_ks is not None:
        k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab).unsqueeze(-1)
        remove |= ranks >= k
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if top_ps is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = top_ps.float().unsqueeze(-1)
        # p = 1 means off: do not let float rounding of the cumsum drop the tail.
        remove |= (mass_before >= top_p) & (top_p < 1.0)
    remove[:, 0] = False
    remove_in_vocab_order = torch.zeros_like(remove).scatter_(-1, sorted_ids, remove)
    return logits.masked_fill(remove_in_vocab_order, float("-inf"))


def exponential_noise(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None] | None
) -> torch.Tensor:
    """Exponential(1) noise shaped like probs; a row with a generator draws from it alone."""
    if generators is None:
        noise = torch.empty_like(probs).exponential_()
    else:
        if len(generators) != probs.shape[0]:
            raise ValueError(
                f"generators has {len(generators)} entries but the batch has {probs.shape[0]} rows"
            )
        noise = torch.empty_like(probs)
        unseeded = [row for row, generator in enumerate(generators) if generator is None]
        if unseeded:  # one draw from torch's generator for all of them
            noise[unseeded] = torch.empty_like(noise[unseeded]).exponential_()
        for row, generator in enumerate(generators):
            if generator is not None:
                if generator.device.type != probs.device.type:
                    raise ValueError(
                        f"generator of row {row} is on {generator.device}, logits on "
                        f"{probs.device}: create it with torch.Generator(device=logits.device)"
                    )
                noise[row].exponential_(generator=generator)
    # E = 0 has probability ~0 but would divide by zero.
    return noise.clamp_min_(1e-10)


def gumbel_sample_gpu(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The common GPU case (temperature only, no per-request seeds): the Triton kernels of
    kernels/sample_kernel.py. Their noise is keyed by one seed per row drawn here from torch's
    generator."""
    from myvllm.kernels.sample_kernel import gumbel_sample_triton

    seeds = torch.randint(0, 2**31 - 1, (logits.shape[0],), device=logits.device)
    return gumbel_sample_triton(logits, temperatures, seeds)
