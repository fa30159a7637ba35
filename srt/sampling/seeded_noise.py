"""Counter-based random numbers: noise[b, k] = f(seed_b, position_b, token_id[b, k]).

Why not a torch.Generator: a generator's stream depends on how many numbers were drawn before,
so a request's draw would depend on which other requests share its batch and on its row.
Hashing (seed, output position, token id) makes every draw a pure function of the request
alone, with no per-row Python loop and no generator state to carry across steps, retractions
or overlap-scheduled batches.

All arithmetic is int64 on values kept below 2^32, and every multiplication is
(< 2^32) * (< 2^28) < 2^60, so nothing overflows a signed 64-bit integer on any device.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd 27-bit multiplier of a well-known 32-bit integer finaliser
_SEED_SALT = 0x2545F491
_POS_SALT = 0x5BD1E995 & 0x0FFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective avalanche mix of 32-bit values held in int64 (input must be in [0, 2^32))."""
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from a 64-bit seed and an output position. Shapes: [B] -> [B]."""
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    k = mix32(lo ^ _SEED_SALT)
    k = mix32(k ^ hi)
    return mix32(k ^ ((positions + _POS_SALT) & _MASK32))


def seeded_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Uniform float32 noise in the open interval (0, 1), shape [B, K].

    `seeds` and `positions` are int64 [B]; `token_ids` int64 [B, K] or [1, K] (broadcast),
    any non-negative ids.
    """
    # The row key is already fully mixed, so one finaliser round per token suffices; for a
    # fixed row it is a bijection of the token id (no two tokens share the 32-bit hash).
    return open_unit_float(mix32(row_keys(seeds, positions).unsqueeze(1) ^ (token_ids & _MASK32)))


def open_unit_float(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (in int64) to float32 in the open interval (0, 1).

    23 random bits, centred in their cells: U in [2^-24, 1 - 2^-24], both ends exactly
    representable in float32. (With 24 bits the top value, 1 - 2^-25, rounds to 1.0, so
    E = -log U could be 0 and a zero-probability token would win argmax(p / E) as NaN.)"""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def seeded_exponential(
    seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Exp(1) noise E = -log(U). argmax(p / E) is a draw from p (the Gumbel-max trick:
    log p - log E = log p + Gumbel), so no normalisation of p is needed."""
    return -torch.log(seeded_uniform(seeds, positions, token_ids))
