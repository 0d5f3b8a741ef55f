"""Docstrings and comments state contracts; measurements live in `docs/benchmarks/`.

A docstring or comment block in `app/`, `engine/` or `retrieval/` (benchmark code under
`*/bench/*` excepted: it prints measurements) may hold at most one measured figure. A second
one makes it a lab notebook whose numbers are never re-measured and soon disagree with their
copies: move them to the `docs/benchmarks/<topic>.md` page that holds the evidence, and link it.

A *figure* is a number with a unit of measure (`12 ms`, `3.2 s`, `2.1x`, `1.5×`, `40%`,
`46 tokens/s`, `1.2 GB/s`, `270 MB`, `5,760 B/token`), a `±`, or a decimal with three or more
places (`0.063`: a KL, a ROUGE-L, an error). Code constants (`0.13`, `1e-5`, `2**20`, `[0.5, 1)`,
shapes such as `[2, heads, tokens, head_dim]`, `30 × 2 × 3`) are not figures.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

from tests.test_layout import REPO

ROOTS = ("app", "engine", "retrieval")

# Files that still hold lab-notebook blocks, each owned by another change in flight; remove a
# line once its file passes (a test says when). Nothing may be added here.
ALLOWED: frozenset[str] = frozenset()

_NUMBER = r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.])\d+(?:\.\d+)?"
_UNIT = (
    r"(?:ms|µs|us|ns|s|min|h|%|tokens/s|tok/s|req/s|rows/s|[KMGT]i?B/s|[KMGT]i?B"
    r"|B/token|nats?)"
)
FIGURE = re.compile(
    rf"(?:{_NUMBER})(?:(?:\s?(?:[-–]|to)\s?)(?:{_NUMBER}))?"  # a number or a range
    rf"(?:\s?(?:{_UNIT})(?![\w/])|[x×](?!\w))"  # with a unit; a factor (2.1x) without a space
    r"|±"
    r"|(?<![\w.])[-+−]?\d{1,3}\.\d{3,}\b"  # 0.063, +0.0126 (not arXiv 2402.02750)
)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    text: str

    def figures(self) -> list[str]:
        return [m.group(0) for m in FIGURE.finditer(self.text)]


def docstrings(tree: ast.Module, path: Path) -> list[Block]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                found.append(Block(path, body[0].lineno, body[0].value.value))
    return found


def comment_blocks(source: str, path: Path) -> list[Block]:
    """Comments on consecutive lines form one block."""
    blocks: list[Block] = []
    lines: list[tuple[int, str]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        row = token.start[0]
        if lines and row != lines[-1][0] + 1:
            blocks.append(Block(path, lines[0][0], "\n".join(text for _, text in lines)))
            lines = []
        lines.append((row, token.string.lstrip("#").strip()))
    if lines:
        blocks.append(Block(path, lines[0][0], "\n".join(text for _, text in lines)))
    return blocks


def blocks_of(path: Path) -> list[Block]:
    source = path.read_text()
    return docstrings(ast.parse(source, filename=str(path)), path) + comment_blocks(source, path)


def source_files() -> list[Path]:
    return sorted(
        path
        for root in ROOTS
        for path in (REPO / root).rglob("*.py")
        if "bench" not in path.relative_to(REPO).parts[:-1]
    )


def notebooks() -> dict[str, list[str]]:
    """{file: ["line: figures"]} of every block holding more than one figure."""
    found: dict[str, list[str]] = {}
    for path in source_files():
        for block in blocks_of(path):
            figures = block.figures()
            if len(figures) > 1:
                name = str(path.relative_to(REPO))
                found.setdefault(name, []).append(f"{block.line}: {', '.join(figures)}")
    return found


def test_no_docstring_or_comment_holds_measurements():
    found = {name: rows for name, rows in notebooks().items() if name not in ALLOWED}
    report = "\n".join(f"{name}:{row}" for name, rows in sorted(found.items()) for row in rows)
    assert not found, (
        "blocks with more than one measured figure (move them to docs/benchmarks/"
        f"<topic>.md and link the page):\n{report}"
    )


def test_the_allow_list_only_names_files_that_still_need_it():
    assert not ALLOWED - set(notebooks()), "remove the files that pass now from ALLOWED"


def test_figures_are_measurements_not_code_constants():
    measured = [
        "TTFT 3.2 s",
        "1.5–2.9× faster",
        "2.1x",
        "40%",
        "46 tokens/s",
        "270 MB",
        "5,760 B/token",
        "KL 0.063",
        "+0.0126 ± 0.0053",
        "36 -> 15 ms",
        "0.3 req/s",
    ]
    constants = [
        "r = 0.13",
        "CCI in [0.5, 1)",
        "[2, heads, tokens, head_dim]",
        "30 × 2 × 3 × 512",
        "1e-5",
        "0x1F",
        "2**20",
        "float16",
        "layers 1, 2 and 6",
        "k4v3",
        "head_dim 64",
        "max_tokens",
        "SmolLM2-135M",
        "arXiv 2402.02750",
        "1536 x 576",
    ]
    assert all(FIGURE.search(text) for text in measured), [
        t for t in measured if not FIGURE.search(t)
    ]
    assert not any(FIGURE.search(text) for text in constants), [
        (t, FIGURE.search(t).group(0)) for t in constants if FIGURE.search(t)
    ]


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_in_the_docs_resolve():
    pages = [
        REPO / "README.md",
        *sorted((REPO / "docs").rglob("*.md")),
        REPO / "app" / "README.md",
        REPO / "engine" / "README.md",
    ]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)
