"""Mode specs: a registered mode, optionally with settings, so configurations compare in one run.

    full
    cacheblend:selection=deviation,check_layers=1     (CacheBlend as published)
    cachecraft:craft_alpha=0.3
    prefix:order=cache-aware                          (the longest cached exact path first)

A spec's settings are `KVMOSAIC_*` setting names (lower case, without the prefix) and are
applied to the whole server of that run; `ratio` is short for `recompute_ratio`, `order` for
`chunk_order`. In a
comma-separated list, a `key=value` item belongs to the spec before it, so a list setting
separates its items by semicolons there (`cacheblend:check_layers=1;2;6`). Settings fixed
when the models load (`LOAD_SETTINGS`: dtype, linear kernel, model, device, embedder) are
refused in a spec: every spec of a run shares one loaded model.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.settings import Settings
from engine.errors import InvalidRequest
from engine.planners import planner_names

ALIASES = {"ratio": "recompute_ratio", "order": "chunk_order"}
# Settings fixed when the models load: every spec of a run shares one loaded model and
# embedder, so a spec could not change them (set them for the whole run instead).
LOAD_SETTINGS = frozenset(
    {"model", "model_path", "device", "dtype", "linear_kernel", "embedder_path", "data_dir"}
)
# Named configurations: what a paper describes, next to our defaults.
# CacheBlend as published: deviation selection at one check layer, no fidelity guard.
# vLLM's automatic prefix caching: exact reuse of the leading chunks in the retriever's order.
PRESETS = {
    "cacheblend-paper": "cacheblend:selection=deviation,check_layers=1,fidelity=fast",
    "prefix-apc": "prefix:order=retrieval",
}


@dataclass(frozen=True)
class ModeSpec:
    """A mode name, the settings it runs with, and its label in tables."""

    mode: str
    settings: tuple[tuple[str, str], ...] = ()
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.mode

    def overrides(self) -> dict[str, str]:
        return dict(self.settings)


def parse_modes(text: str) -> list[ModeSpec]:
    """Specs from a comma-separated list (see the module docstring); InvalidRequest if malformed."""
    specs: list[str] = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item:
            if not specs:
                raise InvalidRequest(f"setting {item!r} comes before any mode")
            specs[-1] += "," + item
        else:
            specs.append(item)
    parsed = [parse_mode(s) for s in specs]
    labels = [s.name for s in parsed]
    if len(set(labels)) != len(labels):
        raise InvalidRequest(f"a mode is named twice: {', '.join(labels)}")
    return parsed


def parse_mode(text: str) -> ModeSpec:
    """One spec: `mode` or `mode:key=value,key=value`, or a preset name."""
    label = ""
    if text in PRESETS:
        label, text = text, PRESETS[text]
    mode, _, rest = text.partition(":")
    mode = mode.strip()
    if mode not in planner_names():
        raise InvalidRequest(f"unknown mode {mode!r}; known modes: {', '.join(planner_names())}")
    settings = []
    for pair in (p.strip() for p in rest.split(",") if p.strip()):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise InvalidRequest(f"mode {mode}: expected key=value, got {pair!r}")
        key = ALIASES.get(key.strip(), key.strip())
        if key not in Settings.model_fields:
            raise InvalidRequest(
                f"mode {mode}: {key!r} is not a setting (`kvmosaic settings` lists them)"
            )
        if key in LOAD_SETTINGS:
            raise InvalidRequest(
                f"mode {mode}: {key!r} is fixed when the model loads and shared by every mode "
                f"of a run; set KVMOSAIC_{key.upper()} (or its flag) for the whole run"
            )
        settings.append((key, value.strip()))
    return ModeSpec(mode, tuple(settings), label or (text if settings else ""))
