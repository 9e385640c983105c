"""The workload of routing.py: chat sessions sharing system prompts, arriving over time,
and the layouts they are served on.

A session is multisession.py's chat: a system prompt, then per turn a user message and
the model's reply, each turn's prompt the conversation so far plus the new message. Here
groups of sessions share their system prompt, sessions start at the times of a Poisson
process, and a session's next turn arrives a think time after its reply ends::

    session 7   start    turn 0 ... reply ends   think   turn 1 ... reply ends   think ...
    prompt      [system of group 3][msg 0][reply 0][msg 1]

Everything random (tokens, prompt groups, start times, think times) is drawn from the
seed before the run, so every policy serves the same sessions arriving at the same
times; only the times of turns after the first depend on how fast a policy serves.
Tokens are distinct counters rather than random ids: a prefix cache only compares them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import attrs

from benchmarks.common.layouts import build_layout
from hybridkv.memory import KVCacheManager
from hybridkv.policies import FullAttention, MemoryPolicy, SlidingWindow

BLOCK_SIZE = 16
#: The prefix-cache hash of the replicas and the router's indexes (the faster of the two
#: the engine offers; what is hashed, not how, decides a hit).
HASH = "xxh3_128"
GiB = 1 << 30


@attrs.frozen
class Layout:
    """A model's KV groups: their policies and the page ids a state page takes."""

    name: str
    policies: tuple[MemoryPolicy, ...]
    state_span: int = 1

    @property
    def is_hybrid(self) -> bool:
        """Some group is not full attention (a full-attention-only router misjudges it)."""
        return any(not isinstance(p, FullAttention) for p in self.policies)

    def manager(self, num_blocks: int) -> KVCacheManager:
        """A KV cache manager of ``num_blocks`` page ids on this layout, rounded up to
        whole state pages."""
        span = self.state_span
        return KVCacheManager(
            self.policies,
            -(-num_blocks // span) * span,
            BLOCK_SIZE,
            hash_name=HASH,
            state_span=span,
        )

    def pages_needed(self, num_tokens: int) -> int:
        """Page ids a request of ``num_tokens`` holds at its longest."""
        return self.manager(self.state_span * (len(self.policies) * 3 + 1)).num_blocks_needed(
            num_tokens
        )


def layouts(window: int) -> dict[str, Layout]:
    """Full attention (the control), Gemma-3-like (1 full : 5 sliding-window groups, the
    window given) and Bamba-like (the planner's groups for Bamba 9B: 10 Mamba2 state
    groups of 3 layers and 1 full-attention group of its 3 attention layers, a state
    page being ``state_span`` K/V pages)."""
    bamba = build_layout("bamba-9b", 64 * GiB, BLOCK_SIZE).pool
    return {
        "full": Layout("full", (FullAttention(),)),
        "gemma-3-like": Layout(
            "gemma-3-like", (FullAttention(),) + (SlidingWindow(window=window),) * 5
        ),
        "bamba-like": Layout("bamba-like", bamba.policies, bamba.state_span),
    }


@attrs.frozen(kw_only=True)
class Workload:
    """The sessions of one scale and how they arrive.

    Attributes:
        num_sessions: Chats.
        num_turns: Turns per chat.
        sessions_per_prompt: Chats per system prompt, on average (each draws one of
            ``ceil(num_sessions / sessions_per_prompt)`` prompts at random).
        system_tokens: Tokens of a system prompt.
        user_tokens: Fewest and most tokens of a user message.
        reply_tokens: Fewest and most tokens of a reply.
        think_ms: Mean time from a reply's end to the next turn (exponential).
        sessions_per_ms: Rate of session starts (a Poisson process).
    """

    num_sessions: int
    num_turns: int
    sessions_per_prompt: int
    system_tokens: int
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    think_ms: float
    sessions_per_ms: float

    def mean_turn_tokens(self) -> float:
        """Tokens a turn adds to the conversation, on average (message and reply)."""
        return (sum(self.user_tokens) + sum(self.reply_tokens)) / 2

    def mean_length(self) -> float:
        """Tokens of a conversation, averaged over the turns."""
        return self.system_tokens + self.mean_turn_tokens() * (self.num_turns + 1) / 2


class Chat:
    """One session: its system prompt, messages, replies, start and think times."""

    __slots__ = ("index", "messages", "replies", "start_ms", "system", "think_ms")

    def __init__(self, index: int, system: list[int], start_ms: float) -> None:
        self.index = index
        self.system = system
        self.start_ms = start_ms
        self.messages: list[list[int]] = []
        self.replies: list[list[int]] = []
        self.think_ms: list[float] = []

    def prompt(self, turn: int) -> list[int]:
        """Turn ``turn``'s prompt (0-based): system, earlier messages and replies, message."""
        out = list(self.system)
        for i in range(turn):
            out += self.messages[i] + self.replies[i]
        return out + self.messages[turn]

    @property
    def num_turns(self) -> int:
        return len(self.messages)


def make_chats(workload: Workload, seed: int) -> list[Chat]:
    """The sessions of ``workload``, in order of their start."""
    rng = random.Random(seed)
    used = 0

    def tokens(n: int) -> list[int]:
        nonlocal used
        used += n
        return list(range(used - n + 1, used + 1))  # ids from 1, never repeated

    num_prompts = -(-workload.num_sessions // workload.sessions_per_prompt)
    systems = [tokens(workload.system_tokens) for _ in range(num_prompts)]
    chats, now = [], 0.0
    for index in range(workload.num_sessions):
        chat = Chat(index, systems[rng.randrange(num_prompts)], now)
        for _ in range(workload.num_turns):
            chat.messages.append(tokens(rng.randint(*workload.user_tokens)))
            chat.replies.append(tokens(rng.randint(*workload.reply_tokens)))
            chat.think_ms.append(rng.expovariate(1 / workload.think_ms))
        chats.append(chat)
        now += rng.expovariate(workload.sessions_per_ms)
    return chats


class Turn:
    """One request: a chat's turn, its tokens so far, and how far it got.

    ``all_token_ids``, ``request_id`` and ``extra_keys`` are what the KV cache manager
    reads (``KVRequest``).
    """

    __slots__ = (
        "all_token_ids",
        "arrival_ms",
        "chat",
        "computed",
        "extra_keys",
        "first_token_ms",
        "is_admitted",
        "num_generated",
        "num_prompt",
        "request_id",
        "turn",
    )

    def __init__(self, chat: Chat, turn: int, arrival_ms: float) -> None:
        self.chat, self.turn, self.arrival_ms = chat, turn, arrival_ms
        self.request_id = f"{chat.index}.{turn}"
        self.all_token_ids = chat.prompt(turn)
        self.extra_keys: tuple[object, ...] = ()
        self.num_prompt = len(self.all_token_ids)  # tokens before the next sample
        self.num_generated = 0
        self.computed = 0
        self.is_admitted = False  # once: its hit counts at its first admission only
        self.first_token_ms: float | None = None

    @property
    def reply(self) -> list[int]:
        return self.chat.replies[self.turn]


def arrivals(chats: list[Chat]) -> Iterator[Turn]:
    """Every chat's first turn, at its start."""
    for chat in chats:
        yield Turn(chat, 0, chat.start_ms)
