"""A model's reuse profile: which blends the `balanced` level may run on it, as measured.

`balanced` promises task accuracy within full prefill's interval and a deviation inside full's
own reorder floor (engine/serving/guard.py). Whether a blend keeps that promise depends on the
model, so the promise is kept per model: its profile names the modes whose guarded blends the
yardstick passed on tuning seeds for that model (`kvmosaic calibrate profile`, by the rule on
docs/benchmarks/profiles.md), with the guard thresholds they passed at. A balanced request whose
mode's blend the profile does not name runs **exact-first**: exact variants and exact prefix
reuse, every other row computed (the exact-reuse plan), so it never loses to `prefix`.

Where a profile comes from, first found wins: a calibrated one in the data dir
(`data_dir/profiles/<fingerprint>.json`, written by `kvmosaic calibrate profile`), the committed
one of a model known by name (engine/profiles/<name>.json), else none: exact-first.
`fast` is never restricted (it promises speed); `exact` runs the reference anyway.
This module reads and writes profiles; it measures nothing.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.config import EngineConfig, Fidelity
from engine.errors import KvMosaicError

PROFILE_FILE_VERSION = 1
# The committed profiles of the models known by name (engine/model/known.py).
KNOWN_PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
# The guard's settings a profile may set for the blends it allows (EngineConfig fields).
GUARD_FIELDS: tuple[str, ...] = (
    "guard_margin",
    "guard_answer_margin",
    "guard_answer_tokens",
    "guard_recompute_ratio",
)


class ProfileError(KvMosaicError):
    """A profile file that cannot be read: its path, what is wrong and the fix."""


@dataclass(frozen=True)
class ReuseProfile:
    """What `balanced` may blend on one model.

    balanced_modes: modes whose guarded blends passed (empty: exact-first for every mode);
    guard: EngineConfig guard fields those blends passed at (replacing the settings' values for
    them); source: where the profile was read from ("none" when no profile exists);
    evidence: the page or file that holds the measurement.
    """

    model: str
    balanced_modes: tuple[str, ...] = ()
    guard: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    source: str = "none"
    evidence: str = ""

    def allows(self, fidelity: Fidelity, mode: str) -> bool:
        """Whether a request at `fidelity` may run `mode`'s blend (False: exact-first)."""
        return not fidelity.guards or mode in self.balanced_modes

    def guarded_config(self, config: EngineConfig) -> EngineConfig:
        """`config` with the guard thresholds this profile's blends passed at (a new config)."""
        changes: dict[str, Any] = dict(self.guard)
        return replace(config, **changes) if changes else config

    @property
    def allowed(self) -> str:
        """What `balanced` may run, in words: the blends it passed, or exact-first."""
        if self.balanced_modes:
            return f"balanced blends {', '.join(self.balanced_modes)}"
        return "balanced is exact-first (no blend measured to hold)"

    @property
    def summary(self) -> str:
        """One line for `/readyz` and the start-up log: what is allowed, and the file."""
        where = self.source
        if self.source == "none":
            where = "no profile yet: `kvmosaic calibrate profile`"
        return f"{self.allowed}; {where}"

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PROFILE_FILE_VERSION,
            "model": self.model,
            "balanced_modes": list(self.balanced_modes),
            "guard": dict(self.guard),
            "evidence": self.evidence,
        }


def calibrated_path(data_dir: Path, fingerprint: str) -> Path:
    """Where `kvmosaic calibrate profile` writes the profile of the model with `fingerprint`."""
    return Path(data_dir) / "profiles" / f"{fingerprint}.json"


def known_path(model_name: str) -> Path:
    """The committed profile of a model known by name."""
    return KNOWN_PROFILES_DIR / f"{model_name}.json"


def load_profile(data_dir: Path, fingerprint: str, model_name: str | None) -> ReuseProfile:
    """The profile in force for a loaded model (module docstring: first found wins).
    `model_name`: the known model's name, None for a checkpoint given by path."""
    candidates = [calibrated_path(data_dir, fingerprint)]
    if model_name is not None:
        candidates.append(known_path(model_name))
    for path in candidates:
        if path.is_file():
            return read_profile(path)
    return ReuseProfile(model=model_name or fingerprint)


def read_profile(path: Path) -> ReuseProfile:
    """The profile in `path`; ProfileError naming the file, the fault and the fix."""
    fix = f"fix or delete {path} (`kvmosaic calibrate profile` writes it again)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProfileError(f"reuse profile {path} cannot be read ({err}): {fix}") from None
    if not isinstance(data, dict) or data.get("version") != PROFILE_FILE_VERSION:
        raise ProfileError(
            f"reuse profile {path} is not a version {PROFILE_FILE_VERSION} profile: {fix}"
        )
    return _profile_of(data, path, fix)


def _profile_of(data: dict[str, Any], path: Path, fix: str) -> ReuseProfile:
    from engine.planners import planner_names

    modes = tuple(data.get("balanced_modes", ()))
    unknown = [m for m in modes if m not in planner_names()]
    guard = dict(data.get("guard", {}))
    bad_fields = [k for k in guard if k not in GUARD_FIELDS]
    if unknown or bad_fields or not isinstance(data.get("model"), str):
        raise ProfileError(
            f"reuse profile {path} names unknown modes {unknown} or guard fields {bad_fields} "
            f"(known: {', '.join(GUARD_FIELDS)}): {fix}"
        )
    try:  # the thresholds must make a valid config
        changes: dict[str, Any] = guard
        replace(EngineConfig(), **changes)
    except (TypeError, ValueError) as err:
        raise ProfileError(f"reuse profile {path} has a bad guard value ({err}): {fix}") from None
    return ReuseProfile(
        model=data["model"],
        balanced_modes=modes,
        guard=MappingProxyType(guard),
        source=str(path),
        evidence=str(data.get("evidence", "")),
    )


def write_profile(path: Path, profile: ReuseProfile, record: Mapping[str, Any]) -> None:
    """Write `profile` with the measurement `record` that decided it, atomically (a temp file
    renamed over the old one: a crash leaves the old profile or the new, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {**profile.to_json(), "measurement": dict(record)}
    fd, tmp = tempfile.mkstemp(prefix=".profile-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(body, out, indent=2)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
