"""Procedural arithmetic problems with a fixed held-out split; needs no download and no optional package.

The default task is the demo's: 2 terms, 1 digit, + and - ("Calculate 7 - 9." -> "-2"), written in
the question style of reasoning-gym's ``basic_arithmetic`` (simple format). A problem is identified by
its expression text; its split is decided by a salted SHA-256 of that text, independent of any
training seed, so the held-out problems never appear in training streams.

- Small problem spaces (<= ``ENUMERATION_LIMIT`` problems, e.g. the 200 of the default task) are
  enumerated; the ``heldout_size`` problems with the smallest hash are held out, the rest train.
- Larger spaces hold out every problem whose hash falls in the lowest ``LARGE_SPACE_HELDOUT_FRACTION``
  of the range; ``heldout_records()`` returns the first ``heldout_size`` of them met by a fixed-seed draw.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random

ENUMERATION_LIMIT = 200_000
LARGE_SPACE_HELDOUT_FRACTION = 0.01
_SPLIT_SALT = "jaxrl_llm-arithmetic-split-v1"
_HASH_RANGE = 2**64
_OPERATORS = ("+", "-", "*")


def _split_hash(expression: str) -> int:
    digest = hashlib.sha256(f"{_SPLIT_SALT}:{expression}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def evaluate_expression(numbers: tuple[int, ...], operators: tuple[str, ...]) -> int:
    """Value of n0 op0 n1 op1 ... with the usual precedence (* before + and -), left to right."""
    total, product = 0, numbers[0]
    sign = 1
    for op, number in zip(operators, numbers[1:]):
        if op == "*":
            product *= number
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), number
    return total + sign * product


def _digit_range(digits: int) -> range:
    # 1 digit means 0-9; d > 1 digits means 10^(d-1) .. 10^d - 1 (no leading zeros)
    return range(0, 10) if digits == 1 else range(10 ** (digits - 1), 10**digits)


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Integer expressions of ``min_terms..max_terms`` terms, each of ``min_digits..max_digits`` digits.

    Every problem draws its number of terms and its digit count uniformly, then each term uniformly from
    the digit range and each operator uniformly from ``operators``. Answers are exact integers.
    """

    min_terms: int = 2
    max_terms: int = 2
    min_digits: int = 1
    max_digits: int = 1
    operators: tuple[str, ...] = ("+", "-")
    heldout_size: int = 100
    question_format: str = "Calculate {expression}."
    name: str = "arithmetic"

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got {self.min_terms}..{self.max_terms}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}..{self.max_digits}")
        bad_ops = [op for op in self.operators if op not in _OPERATORS]
        if not self.operators or bad_ops:
            raise ValueError(f"operators must be a non-empty subset of {_OPERATORS}, got {self.operators}")
        if "{expression}" not in self.question_format:
            raise ValueError("question_format must contain '{expression}'")
        if self.heldout_size < 0:
            raise ValueError(f"heldout_size must be >= 0, got {self.heldout_size}")
        if self.enumerable and self.heldout_size >= self.space_size:
            raise ValueError(f"heldout_size {self.heldout_size} leaves no training problems "
                             f"(the task has {self.space_size} distinct problems)")

    @property
    def space_size(self) -> int:
        """Number of distinct problems (expressions) the task can produce."""
        ops = len(self.operators)
        return sum(len(_digit_range(d)) ** t * ops ** (t - 1)
                   for t in range(self.min_terms, self.max_terms + 1)
                   for d in range(self.min_digits, self.max_digits + 1))

    @property
    def enumerable(self) -> bool:
        return self.space_size <= ENUMERATION_LIMIT

    # -- problems ---------------------------------------------------------------------------------

    def expression(self, numbers, operators) -> str:
        parts = [str(numbers[0])]
        for op, number in zip(operators, numbers[1:]):
            parts += [op, str(number)]
        return " ".join(parts)

    def record(self, numbers, operators, *, record_id: str) -> dict:
        expression = self.expression(numbers, operators)
        return {"id": record_id, "source": self.name, "question": self.question_format.format(expression=expression),
                "answer": str(evaluate_expression(tuple(numbers), tuple(operators))), "expression": expression}

    def _all_problems(self):
        for terms in range(self.min_terms, self.max_terms + 1):
            for digits in range(self.min_digits, self.max_digits + 1):
                for numbers in itertools.product(_digit_range(digits), repeat=terms):
                    for ops in itertools.product(self.operators, repeat=terms - 1):
                        yield numbers, ops

    def _draw(self, rng: random.Random):
        terms = rng.randint(self.min_terms, self.max_terms)
        digits_range = _digit_range(rng.randint(self.min_digits, self.max_digits))
        numbers = tuple(rng.randrange(digits_range.start, digits_range.stop) for _ in range(terms))
        ops = tuple(rng.choice(self.operators) for _ in range(terms - 1))
        return numbers, ops

    # -- split ------------------------------------------------------------------------------------

    def _heldout_problems(self) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
        if self.enumerable:
            ranked = sorted(self._all_problems(), key=lambda p: _split_hash(self.expression(*p)))
            return ranked[: self.heldout_size]
        rng = random.Random(_SPLIT_SALT)  # a fixed draw: the split must not depend on any training seed
        found: dict[str, tuple] = {}
        while len(found) < self.heldout_size:
            problem = self._draw(rng)
            expression = self.expression(*problem)
            if self._in_large_heldout(expression):
                found.setdefault(expression, problem)
        return sorted(found.values(), key=lambda p: _split_hash(self.expression(*p)))

    @staticmethod
    def _in_large_heldout(expression: str) -> bool:
        return _split_hash(expression) < LARGE_SPACE_HELDOUT_FRACTION * _HASH_RANGE

    def heldout_expressions(self) -> frozenset[str]:
        """Expressions of the held-out split (for the large-space rule: the ones ``heldout_records`` returns)."""
        return frozenset(self.expression(*p) for p in self._heldout_problems())

    def is_heldout(self, expression: str) -> bool:
        """Whether ``expression`` belongs to the held-out split (and so never to training)."""
        if self.enumerable:
            return expression in self._heldout_set()
        return self._in_large_heldout(expression)

    def _heldout_set(self) -> frozenset[str]:
        cached = self.__dict__.get("_heldout_cache")
        if cached is None:
            cached = self.heldout_expressions()
            object.__setattr__(self, "_heldout_cache", cached)  # frozen dataclass: cache on the instance
        return cached

    def heldout_records(self) -> list[dict]:
        """The fixed held-out problems, ``heldout_size`` of them, in hash order (ids ``{name}-heldout-{i}``)."""
        return [self.record(numbers, ops, record_id=f"{self.name}-heldout-{i}")
                for i, (numbers, ops) in enumerate(self._heldout_problems())]

    def train_records(self, num: int | None = None, *, seed: int = 0) -> list[dict]:
        """Training problems, none of them held out.

        ``num=None`` (enumerable tasks only): every non-held-out problem once, in enumeration order
        (the pipeline shuffles). ``num=n``: n problems drawn i.i.d.; problem i depends only on
        (seed, i), so a longer list extends a shorter one.
        """
        if num is None:
            if not self.enumerable:
                raise ValueError(f"task has {self.space_size} problems, too many to list: pass num=")
            return [self.record(numbers, ops, record_id=f"{self.name}-train-{i}")
                    for i, (numbers, ops) in enumerate(
                        p for p in self._all_problems() if not self.is_heldout(self.expression(*p)))]
        records = []
        for index in range(num):
            rng = random.Random(f"{seed}:{index}")  # str seeds hash with SHA-512: stable across runs
            problem = self._draw(rng)
            while self.is_heldout(self.expression(*problem)):
                problem = self._draw(rng)
            records.append(self.record(*problem, record_id=f"{self.name}-s{seed}-{index}"))
        return records
