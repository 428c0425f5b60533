"""Randomised multi-turn chat sessions with shared system prompts, as token ids."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Session:
    system: list[int]
    users: list[list[int]]  # one user message per turn
    max_new: list[int]  # max_new_tokens per turn
    history: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def make_sessions(
    n: int,
    *,
    seed: int = 0,
    vocab: int = 1000,
    systems: int = 3,
    system_len: tuple[int, int] = (24, 40),
    turns: tuple[int, int] = (2, 4),
    user_len: tuple[int, int] = (4, 20),
    new_tokens: tuple[int, int] = (3, 8),
) -> list[Session]:
    rnd = random.Random(seed)
    sys_prompts = [
        [rnd.randrange(5, vocab) for _ in range(rnd.randint(*system_len))] for _ in range(systems)
    ]
    out = []
    for _ in range(n):
        k = rnd.randint(*turns)
        out.append(
            Session(
                system=list(rnd.choice(sys_prompts)),
                users=[[rnd.randrange(5, vocab) for _ in range(rnd.randint(*user_len))]
                       for _ in range(k)],
                max_new=[rnd.randint(*new_tokens) for _ in range(k)],
            )
        )
    return out


def run_sessions(engine: Any, sessions: list[Session], *, batch: bool = True) -> list[list[int]]:
    """Play every session turn by turn (each round's requests submitted together when `batch`,
    else one at a time). Returns every output in a fixed order (session-major)."""
    for s in sessions:
        s.history = list(s.system)
        s.outputs = []
    rounds = max(len(s.users) for s in sessions)
    for r in range(rounds):
        active = [s for s in sessions if r < len(s.users)]
        prompts = [s.history + s.users[r] for s in active]
        params = [{"max_new_tokens": s.max_new[r], "ignore_eos": True} for s in active]
        if batch:
            results = engine.generate(input_ids=prompts, sampling_params=params)
        else:
            results = [engine.generate(input_ids=p, sampling_params=sp)[0]
                       for p, sp in zip(prompts, params)]
        for s, p, res in zip(active, prompts, results):
            s.outputs.append(res["output_ids"])
            s.history = p + res["output_ids"]
    return [o for s in sessions for o in s.outputs]
