"""Answerable evaluation cases: invented facts that no model knows, asked over distractors.

Each case is a benchmark record (`{question, answers, ctxs: [{title, text}], kind}`, the
format `load_dataset` reads): a handful of passages about invented places of the same shape,
one (or two) of which hold the answer. The kinds:
- `single`: one fact of one place (its founding year, its founder, its river, ...);
- `twohop`: where the founder of a place was born, the founder named in the place's passage
  and the birthplace in the founder's own passage (the bridge is stated, never implied);
- `compare`: which of two places was founded earlier, both years stated.
Passages carry a few filler sentences so that chunks are of a realistic size and the answer
is not the only thing a passage says.

A case depends only on (seed, index): `generate_cases(seed, n)` is reproducible, and two seeds
share no case. Tune on some seeds and report on others (`TUNING_SEEDS`, `REPORT_SEEDS`).
Why invented facts: the embedded model must read the passage to answer, so accuracy measures
what the prompt's KV delivers, not what the weights remember.

    python -m bench.fidelity.cases --seed 1000 --n 200 --out cases.json
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("single", "twohop", "compare")
TUNING_SEEDS = range(0, 1000)  # calibrate on these ...
REPORT_SEEDS = range(1000, 2000)  # ... and report on these

_ONSETS = (
    "br",
    "c",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "qu",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "th",
    "st",
    "gr",
    "dr",
    "tr",
    "sk",
    "vel",
    "mor",
)
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou", "y")
_CODAS = (
    "n",
    "r",
    "l",
    "th",
    "rn",
    "nd",
    "sk",
    "mar",
    "dor",
    "wen",
    "ric",
    "mont",
    "stad",
    "holm",
    "wick",
)
_GIVEN = (
    "Odalys",
    "Beren",
    "Maelis",
    "Torvald",
    "Isenne",
    "Caspian",
    "Liora",
    "Anselm",
    "Veyra",
    "Doran",
    "Ysolde",
    "Hadrian",
    "Nerys",
    "Evander",
    "Sabine",
    "Aurelio",
    "Kestra",
    "Joran",
    "Milena",
    "Tobias",
)
_TRADES = (
    "copper mills",
    "glass workshops",
    "salt pans",
    "wool markets",
    "clock makers",
    "rope walks",
    "paper mills",
    "tanneries",
    "fishing fleets",
    "vineyards",
    "stone quarries",
    "dye works",
)
_FESTIVALS = (
    "lantern festival",
    "harvest fair",
    "river regatta",
    "winter market",
    "kite festival",
    "music week",
    "horse fair",
    "bell festival",
)
_FILLER = (
    "Its old town keeps a covered market hall built of grey stone.",
    "A narrow bridge with seven arches links the two halves of the town.",
    "Local records describe a great flood that damaged the lower streets.",
    "The town library holds a collection of early maps of the region.",
    "Travellers often stop there on the road between the coast and the hills.",
    "The main square is lined with painted houses and a small fountain.",
    "A railway station was added much later, at the edge of the town.",
    "Its council meets in a hall decorated with carved wooden panels.",
)


@dataclass(frozen=True)
class Place:
    """One invented place and the facts its passage states."""

    name: str
    province: str
    year: int
    founder: str
    founder_birthplace: str
    river: str
    trade: str
    festival: str
    population: int


def generate_cases(
    seed: int, n: int, chunks: int = 6, kinds: Sequence[str] = KINDS
) -> list[dict[str, Any]]:
    """`n` cases of seed `seed`, `chunks` passages each, kinds taken in turn; reproducible.

    Raises ValueError for fewer than 2 chunks or an unknown kind."""
    if chunks < 2:
        raise ValueError("a case needs at least 2 passages (one holds the answer, one distracts)")
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"unknown case kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    return [
        _case(random.Random(f"kvmosaic-cases-{seed}-{i}"), kinds[i % len(kinds)], chunks)
        for i in range(n)
    ]


def _case(rng: random.Random, kind: str, chunks: int) -> dict[str, Any]:
    names = _distinct_names(rng, 3 * chunks)
    years = rng.sample(range(1120, 1890), chunks)  # distinct: a comparison always has one answer
    places = [
        _place(rng, names[i], names[chunks + i], names[2 * chunks + i], years[i])
        for i in range(chunks)
    ]
    ctxs = [{"title": p.name, "text": _place_passage(rng, p)} for p in places]
    if kind == "single":
        question, answer = _single_question(rng, places[0])
    elif kind == "twohop":
        question, answer = _twohop(rng, places, ctxs)
    else:
        question, answer = _compare(rng, places)
    order = list(range(len(ctxs)))
    rng.shuffle(order)  # the answer's passage lands anywhere in the retriever's order
    return {
        "question": question,
        "answers": [answer],
        "ctxs": [ctxs[i] for i in order],
        "kind": kind,
    }


def _distinct_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = (rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)).capitalize()
        if name not in names and len(name) >= 5:
            names.append(name)
    return names


def _place(rng: random.Random, name: str, province: str, river: str, year: int) -> Place:
    founder = (
        f"{rng.choice(_GIVEN)} {province[:3]}{rng.choice(('wright', 'ley', 'ford', 'mere', 'by'))}"
    )
    return Place(
        name=name,
        province=f"{province}ia",
        year=year,
        founder=founder,
        founder_birthplace="",
        river=f"the {river}",
        trade=rng.choice(_TRADES),
        festival=rng.choice(_FESTIVALS),
        population=rng.randint(3, 95) * 1000,
    )


def _place_passage(rng: random.Random, p: Place) -> str:
    facts = [
        f"{p.name} is a town in the province of {p.province}.",
        f"It was founded in {p.year} by {p.founder}.",
        f"The river {p.river[4:]} flows through the town.",
        f"{p.name} is known for its {p.trade} and its yearly {p.festival}.",
        f"About {p.population:,} people live there today.",
    ]
    return " ".join(facts + rng.sample(_FILLER, 2))


def _single_question(rng: random.Random, p: Place) -> tuple[str, str]:
    asks = [
        (f"In which year was {p.name} founded?", str(p.year)),
        (f"Who founded the town of {p.name}?", p.founder),
        (f"Which river flows through {p.name}?", p.river[4:]),
        (f"In which province is {p.name}?", p.province),
        (f"What is {p.name} known for, besides its {p.festival}?", p.trade),
    ]
    return rng.choice(asks)


def _twohop(rng: random.Random, places: list[Place], ctxs: list[dict[str, str]]) -> tuple[str, str]:
    """The founder of places[0] gets a passage of their own (replacing the last distractor)."""
    target, birthplace = places[0], places[1].name
    born = rng.randint(target.year - 60, target.year - 25)
    ctxs[-1] = {
        "title": target.founder,
        "text": (
            f"{target.founder} was born in {born} in the town of {birthplace}. "
            f"As a young merchant {target.founder.split()[0]} travelled widely "
            f"and later settled far from home. Letters written by {target.founder} "
            "describe long journeys by boat and by cart."
        ),
    }
    return f"In which town was the founder of {target.name} born?", birthplace


def _compare(rng: random.Random, places: list[Place]) -> tuple[str, str]:
    """Which of places[0] and places[1] (distinct years) was founded earlier."""
    pair = [places[0], places[1]]
    rng.shuffle(pair)
    earlier = min(pair, key=lambda p: p.year)
    return f"Which town was founded earlier, {pair[0].name} or {pair[1].name}?", earlier.name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--seed", type=int, required=True, help="tune on 0-999, report on 1000-1999"
    )
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=6, help="passages per case")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cases = generate_cases(
        args.seed, args.n, args.chunks, tuple(k.strip() for k in args.kinds.split(","))
    )
    args.out.write_text(json.dumps(cases, indent=1))
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
