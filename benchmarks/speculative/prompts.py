"""The prompts of ``speculative.py``: what a copy-heavy and a free workload ask the model."""

from __future__ import annotations

import attrs

from hybridkv.serving.cli.loading import LoadedModel

_RIVER = (
    "The river rose slowly through the night, and by morning the low fields near the mill "
    "were under a foot of brown water. The miller's daughter walked the bank with a lantern, "
    "counting the fence posts that still showed above the flood, and wrote each number in "
    "a small notebook she kept in her coat. By noon the water had stopped rising."
)
_TRAIN = (
    "The night train to the coast leaves the central station at ten past eleven. Passengers "
    "with sleeping berths should board from platform four, where the guard checks tickets "
    "at the door of each carriage. Breakfast is served in the dining car from half past six, "
    "and the train arrives at the harbour an hour later, in time for the first ferry."
)
_GARDEN = (
    "In early spring the garden looks empty, but under the soil the bulbs are already "
    "awake. First come the snowdrops, then the crocuses, purple and yellow, and at last "
    "the tulips that my grandmother planted along the wall forty years ago. Every April "
    "she would walk along the path and count them, and every year there were a few more."
)
_TYPOS = (
    "Our libary will be closed on Monday becuase of the public holliday. Books that are due "
    "on that day can be returned on Tuesday without a fine. The childrens reading group "
    "will meet as usual on Wednesday afternon, and new members are alway welcome. Please "
    "ask at the front desk if you need help finding a book."
)
_FUNCTION = """```python
def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
```"""
_RENAME = """```python
def summarize(data):
    count = len(data)
    if count == 0:
        return {"count": 0, "mean": None}
    mean = sum(data) / count
    largest = max(data)
    smallest = min(data)
    return {"count": count, "mean": mean, "max": largest, "min": smallest}
```"""
_LETTER = (
    "Dear Anna,\n\nThank you for the lovely flowers you sent for my birthday. They are on "
    "the kitchen table and the whole house smells of them. I hope you can visit us in the "
    "summer, when the garden is at its best. Anna, please give my love to your parents.\n\n"
    "With warm wishes,\nElisabeth"
)

_OPENINGS = [
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "The old lighthouse keeper climbed the stairs one last time. At the top, he",
    "Marie opened the letter with shaking hands. It was from her brother, who",
    "The detective looked at the muddy footprints on the kitchen floor and said,",
    "When the spaceship landed in the middle of the football field, the crowd",
    "My grandfather used to tell me stories about the war. One evening he",
    "It was the first day of the summer holidays, and Tom had a plan:",
    "The market was busy that morning. Between the fish stalls and the flower sellers,",
]


@attrs.frozen
class Workload:
    """Prompts, as the user's turn of a chat (``chat``) or as text to continue."""

    texts: list[str]
    chat: bool
    repetition_penalty: float = 1.0


WORKLOADS: dict[str, Workload] = {
    "copy": Workload(
        [
            f"Repeat the following text exactly:\n\n{_RIVER}",
            "Correct the spelling mistakes in the following text and write it out in full:"
            f"\n\n{_TYPOS}",
            "Add a docstring to this Python function and write out the whole function:"
            f"\n\n{_FUNCTION}",
            f"Repeat the following text exactly:\n\n{_TRAIN}",
            f"Rewrite this function with the parameter `data` renamed to `records`:\n\n{_RENAME}",
            f"Write out this letter again, with the name Anna changed to Maria:\n\n{_LETTER}",
            f"Repeat the following text exactly:\n\n{_GARDEN}",
            f"Copy the following text, word for word:\n\n{_RIVER} {_TRAIN}",
        ],
        chat=True,
    ),
    # The built-in model continues text (its GGUF has no chat template; asked in a chat
    # turn for a story, it repeats the question), so open-ended prompts are openings.
    "free": Workload(_OPENINGS, chat=False),
    # The same, with a repetition penalty (still greedy): text that does not repeat itself.
    "free-penalised": Workload(_OPENINGS, chat=False, repetition_penalty=1.3),
}


def prompt_ids(model: LoadedModel, workload: Workload) -> list[list[int]]:
    """The workload's prompts as token ids: a chat turn in the model's template (which
    writes BOS itself), or the text after BOS."""
    prompts = []
    for text in workload.texts:
        if workload.chat:
            rendered = model.chat_template.render([{"role": "user", "content": text}])
            ids = model.tokenizer.encode(rendered, add_special_tokens=False).ids
        else:
            ids = model.tokenizer.encode(text, add_special_tokens=True).ids
        prompts.append(list(ids))
    return prompts
