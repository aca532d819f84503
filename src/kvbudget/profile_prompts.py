"""Short built-in profiling prompts (original text written for kvbudget): one prose, one code.

They let BaKlaVa and SqueezeAttention run on any model without a profile file (a default profile
is built from them on the fly). `kvbudget profile` with longer prompts (Austen, the standard
library) gives a better profile; BaKlaVa's paper profiles prompts of a few hundred tokens or more.
"""

from __future__ import annotations

BUILTIN_TEXT = """\
The harbour town woke slowly on market days. Before the light had reached the roofs, the fishing
boats came in one after another, low in the water, and the women on the quay began to sort the
catch into baskets of wet wicker. Old Tomas, who had not been to sea for eleven years, still
walked down every morning to count the boats, and he always counted them twice, because the
first number never seemed right to him. The baker opened her shutters at six. The smell of bread
drifted along the narrow street and mixed with the smell of salt and tar, and the children who
were sent for loaves came back with the ends already torn off. By eight the square was full.
Farmers from the valley had brought cheese, apples, honey and a goat that nobody wanted to buy;
a man from the city sold knives and promised that each one would last a lifetime, which was
true only in the sense that none of his customers ever found him again. At noon the bell of the
small church rang, a little out of tune, and the stall keepers covered their goods against the
sun. In the afternoon the talk turned, as it always did, to the weather and to the price of
diesel, and then to the question of whether the new harbour wall would be finished before the
winter storms. The mayor said it would. The builders said it might. Tomas said nothing, counted
the boats again, and went home to write the numbers in the notebook he had kept since his
first season, a record of forty years of mornings that no one else had ever asked to read.
"""

BUILTIN_CODE = '''\
from collections import deque


class RateLimiter:
    """Allow at most `limit` events in any window of `period` seconds."""

    def __init__(self, limit: int, period: float) -> None:
        if limit <= 0 or period <= 0:
            raise ValueError("limit and period must be positive")
        self.limit = limit
        self.period = period
        self.events: deque[float] = deque()

    def allow(self, now: float) -> bool:
        while self.events and now - self.events[0] >= self.period:
            self.events.popleft()
        if len(self.events) < self.limit:
            self.events.append(now)
            return True
        return False


def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals; the result is sorted by start."""
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def word_counts(lines):
    counts = {}
    for line in lines:
        for word in line.lower().split():
            word = word.strip(".,;:!?\\"'()")
            if word:
                counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


if __name__ == "__main__":
    limiter = RateLimiter(3, 1.0)
    print([limiter.allow(t / 4) for t in range(8)])
    print(merge_intervals([(1, 3), (2, 6), (8, 10), (9, 12)]))
    print(word_counts(["The cat sat.", "The cat ran!"])[:2])
'''
