"""The problems of GSM8K's kind (a question, a number read as the completion's last): GSM8K's own
files, and arithmetic generated from a seed that a small model gets right some of the time.

    python -m lab.problems OUT_DIR     # the arithmetic as GSM8K's train.jsonl and test.jsonl

Each is a pair of lists (train, test) of (question, gold answer)."""

import json
import os
import random
import re
import shutil
import sys
import urllib.request

GSM8K_URL = (
    "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/"
)


def normalise(number):  # "$1,234.50" -> "1234.5", "18.0" -> "18"
    s = number.strip().replace(",", "").replace("$", "")
    return s.rstrip("0").rstrip(".") if "." in s else s


def gsm8k(data_dir):  # GSM8K's train and test splits
    return read_gsm8k(data_dir, "train"), read_gsm8k(data_dir, "test")


def read_gsm8k(data_dir, split):
    """[(question, normalised gold answer)] of a split; without data_dir, downloaded once and
    cached in ~/.cache/score-centering/gsm8k."""
    cache = os.path.expanduser("~/.cache/score-centering")
    path = os.path.join(data_dir or os.path.join(cache, "gsm8k"), f"{split}.jsonl")
    if not os.path.exists(path):
        _download(path, split, fresh=not os.path.exists(cache), cache=cache)
    problems = []
    for n, line in enumerate(open(path, "rb").read().split(b"\n"), 1):
        if line.strip():  # blank lines (a trailing one, say) are not problems
            problems.append(_problem(line, f"{path}:{n}"))
    if not problems:
        raise ValueError(
            f"{path} holds no problems: pass --data-dir with GSM8K's train.jsonl and test.jsonl"
        )
    return problems


def _problem(line, where):  # one line of GSM8K's jsonl -> (question, normalised gold)
    try:
        row = json.loads(line.decode("utf-8"))
        gold = normalise(row["answer"].split("####")[1])
        if not re.fullmatch(r"-?\d+(\.\d+)?", gold):
            raise ValueError(f"the gold answer {gold!r} is not a number")
        return row["question"], gold
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{where}: not a GSM8K line with a 'question' and an 'answer' ending in "
            f"'#### <number>' ({type(e).__name__}: {e})"
        ) from None


def _download(path, split, fresh, cache):  # GSM8K's split from GitHub, through a .part file
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def progress(n, size, total):
        done, total = min(n * size, total) / 1e6, total / 1e6
        print(f"\rdownloading GSM8K {split}: {done:.1f} / {total:.1f} MB", end="")

    try:
        urllib.request.urlretrieve(GSM8K_URL + f"{split}.jsonl", path + ".part", progress)
    except OSError as e:
        if fresh:  # no empty cache folder left behind
            shutil.rmtree(cache)
        raise ValueError(
            f"GSM8K could not be downloaded from GitHub ({getattr(e, 'reason', e)}): pass "
            "--data-dir with train.jsonl and test.jsonl"
        ) from None
    os.replace(path + ".part", path)
    print()


# -------------------------------------------------------------------------------------------------
# Arithmetic with room to learn for a small model: sums and differences of terms up to 12, times
# tables, each in ten wordings. SmolLM2-135M-Instruct sampled at temperature 1 answers 12% of it
# (192 training problems; docs/real_model.md), where it answers word problems, and sums with a
# two-digit term, 2-7% of the time.

N_TEST = 400  # held out: a 95% interval of at most ±5 points
HELD_OUT = 0.25  # the share of sums whose every wording is held out
WORDINGS = dict(  # ten wordings an operation
    add=(
        "What is {a} + {b}?",
        "What is {a} plus {b}?",
        "Compute {a} + {b}.",
        "What is the sum of {a} and {b}?",
        "Add {a} and {b}.",
        "How much is {a} plus {b}?",
        "Calculate {a} + {b}.",
        "What do you get when you add {a} and {b}?",
        "Find {a} + {b}.",
        "What is {b} added to {a}?",
    ),
    subtract=(
        "What is {a} - {b}?",
        "What is {a} minus {b}?",
        "Compute {a} - {b}.",
        "What is the difference between {a} and {b}?",
        "Subtract {b} from {a}.",
        "How much is {a} minus {b}?",
        "Calculate {a} - {b}.",
        "What do you get when you take {b} away from {a}?",
        "Find {a} - {b}.",
        "What is {a} take away {b}?",
    ),
    multiply=(
        "What is {a} times {b}?",
        "What is {a} multiplied by {b}?",
        "Compute {a} x {b}.",
        "What is the product of {a} and {b}?",
        "Multiply {a} by {b}.",
        "How much is {a} times {b}?",
        "Calculate {a} * {b}.",
        "What do you get when you multiply {a} by {b}?",
        "Find {a} x {b}.",
        "What is {a} groups of {b}?",
    ),
)
SUMS = dict(  # each operation's (a, b, answer): terms and answers up to 12, and times tables
    add=[(a, b, a + b) for a in range(1, 13) for b in range(1, 13)],
    subtract=[(a + b, b, a) for a in range(1, 13) for b in range(1, 13)],
    multiply=[(a, b, a * b) for a in range(2, 13) for b in range(2, 13)],
)


def arithmetic(seed=0):
    """(train, test): lists of (question, gold answer). A sum (3 + 4 and 4 + 3 are one) is held
    out in every wording, so no held-out problem's arithmetic occurs in training; the first N_TEST
    held out are kept."""
    rng = random.Random(seed)
    sums = [(op, *s) for op, rows in SUMS.items() for s in rows]
    keys = sorted({key(*s) for s in sums})
    rng.shuffle(keys)
    held_out = set(keys[: round(HELD_OUT * len(keys))])
    train, test = [], []
    for op, a, b, answer in sums:
        for wording in WORDINGS[op]:
            split = test if key(op, a, b, answer) in held_out else train
            split.append((wording.format(a=a, b=b), str(answer)))
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test[:N_TEST]


def key(op, a, b, answer):  # the same sum whatever the order of its terms, where order is moot
    return (op, a, b) if op == "subtract" else (op, min(a, b), max(a, b))


def write(folder):  # the problems as GSM8K's jsonl: gsm8k() reads them back
    os.makedirs(folder, exist_ok=True)
    for split, rows in zip(("train", "test"), arithmetic(), strict=True):
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            for question, gold in rows:
                f.write(json.dumps(dict(question=question, answer=f"#### {gold}")) + "\n")
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2 or os.path.exists(sys.argv[1]):
        raise SystemExit("usage: python -m lab.problems OUT_DIR (a folder that does not exist)")
    print(f"wrote {write(sys.argv[1])}: train.jsonl, test.jsonl")
