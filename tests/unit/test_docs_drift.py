"""The docs held to the code, so they cannot drift from it silently.

Each test reads what a newcomer reads (README.md, docs/*.md, RELIABILITY.md,
SECURITY.md, deploy/README.md) and compares it with the code it describes:
the settings' defaults, the module paths, the benchmark's figures (rendered
from ``bench/results/latest.json`` by :mod:`bench.figures`) and the Redis ACLs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_core import PydanticUndefined

from app.redis_acl import acl_commands
from app.settings import Settings
from bench import figures

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "RELIABILITY.md", REPO / "SECURITY.md", REPO / "deploy" / "README.md",
               *(REPO / "docs").glob("*.md")])  # fmt: skip
#: The packages whose every module docs/architecture.md and README.md name.
PRODUCT = ("app", "pipeline", "models", "agents", "gateway", "tools")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _outside_bench_blocks(text: str) -> str:
    return re.sub(r"<!-- bench:([a-z-]+) -->\n.*?<!-- /bench:\1 -->", "", text, flags=re.S)


# --- the benchmark's figures ------------------------------------------------------------------------------------


def test_the_bench_blocks_are_what_the_committed_results_render() -> None:
    """README.md and docs/performance.md quote the last `make bench` run only
    through blocks that `bench.run` rewrites from latest.json: after a run the
    blocks and the JSON change together, and a hand edit of a figure fails here."""
    doc = json.loads(figures.LATEST.read_text())
    blocks = figures.render(doc)
    for path in figures.DOCS:
        text = path.read_text()
        assert figures.replace_blocks(text, blocks) == text, (
            f"{_rel(path)}: a bench block differs from bench/results/latest.json: run `python -m bench.figures`"
        )
    assert "<!-- bench:headline -->" in (REPO / "README.md").read_text()
    performance = (REPO / "docs" / "performance.md").read_text()
    assert "<!-- bench:summary -->" in performance and "<!-- bench:sizing -->" in performance


def test_a_bench_block_renders_the_run_it_is_given() -> None:
    """The blocks follow the JSON: another run's knee appears in them, the old one goes."""
    doc = json.loads(figures.LATEST.read_text())
    knee = doc["max_sustainable"]["batched"]["p99_under_200ms"]
    doc["max_sustainable"]["batched"]["p99_under_200ms"] = {**knee, "tps": 1234.0, "bracket": [1234.0, 1300.0]}
    text = "before\n<!-- bench:headline -->\nold 2,950 TPS\n<!-- /bench:headline -->\nafter\n"
    out = figures.replace_blocks(text, figures.render(doc))
    assert "**1,234 TPS at p99 < 200 ms**" in out and "fails 1,300" in out
    assert "2,950" not in out and out.startswith("before\n") and out.endswith("after\n")
    with pytest.raises(KeyError):
        figures.replace_blocks("<!-- bench:nosuch -->\nx\n<!-- /bench:nosuch -->", figures.render(doc))


def test_a_bench_run_rewrites_the_blocks_of_the_documents_once(tmp_path: Path) -> None:
    """What `bench.run` calls after writing latest.json: the blocks change, the prose around them does not."""
    doc = json.loads(figures.LATEST.read_text())
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n<!-- bench:headline -->\nstale\n<!-- /bench:headline -->\n\nProse.\n")
    assert figures.update_docs(doc, [page]) == [page]
    text = page.read_text()
    assert "stale" not in text and figures.render(doc)["headline"] in text and text.endswith("\n\nProse.\n")
    assert figures.update_docs(doc, [page]) == []  # already current: nothing rewritten


#: A claim about what the pipeline sustains or where it saturates, with a number.
_THROUGHPUT_CLAIM = re.compile(r"\b(sustain\w*|saturat\w*|keeps? p99)\b[^.|]{0,60}?\d[\d,]* ?(TPS|decisions/s)", re.I)


@pytest.mark.parametrize("name", ["README.md", "docs/operations.md", "docs/architecture.md", "docs/decisions.md",
                                  "docs/configuration.md", "deploy/README.md"])  # fmt: skip
def test_throughput_claims_come_from_the_bench_blocks(name: str) -> None:
    """Outside the rendered blocks these pages say what the pipeline sustains
    only by pointing at them: a typed figure outlives the run it came from."""
    text = _outside_bench_blocks((REPO / name).read_text())
    claims = [m.group(0) for m in _THROUGHPUT_CLAIM.finditer(text)]
    assert not claims, f"{name}: throughput figures typed by hand: {claims}"


# --- settings defaults ------------------------------------------------------------------------------------------


def _default(env_name: str) -> Any:
    field = Settings.model_fields[env_name.removeprefix("FRAUD_").lower()]
    assert field.default is not PydanticUndefined, f"{env_name} has no plain default to document"
    return field.default


#: Defaults the docs describe in words because they are worked out at start.
_COMPUTED = {"host name and web port": None}


#: Units the docs state durations and sizes in, to the settings' own (seconds, bytes).
_UNITS = {"ms": 0.001, "s": 1.0, "days": 86400.0, "KiB": 1024.0}


def _number(number: str, unit: str | None, field: str) -> float:
    value = float(number.replace(",", ""))
    if unit == "ms" and field.endswith("_ms"):
        return value
    return value * _UNITS[unit] if unit else value


def _parse(text: str, field: str) -> Any:
    """A default as a table cell states it: ``unset``, ``false``, ``8``, ``10,000``, ``0.05``, ``120 days``, a path."""
    text = re.sub(r"\(.*?\)", "", text).replace("`", "").strip()
    quantity = re.fullmatch(r"(-?[\d,]+(?:\.\d+)?) (ms|s|days|KiB)", text)
    if quantity:
        return _number(quantity.group(1), quantity.group(2), field)
    if text in _COMPUTED:
        return _COMPUTED[text]
    if text == "unset":
        return None
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", text):
        return float(text.replace(",", ""))
    return text


def _same(documented: Any, default: Any) -> bool:
    if documented == "off":
        return default in (None, False, 0)
    if documented is None or isinstance(documented, bool):
        return documented is default or (documented is None and default is None)
    if isinstance(documented, float):
        return not isinstance(default, bool) and isinstance(default, (int, float)) and documented == float(default)
    if isinstance(default, Path):
        return Path(documented).expanduser() == default.expanduser()
    return str(documented) == str(default)


def _table_defaults() -> Iterator[tuple[str, str, str]]:
    """(file, FRAUD_* name, the default its table states) for every table with a `default` column."""
    for path in DOCS:
        column = None
        for line in _outside_bench_blocks(path.read_text()).splitlines():
            if not line.startswith("|"):
                column = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if column is None:
                column = cells.index("default") if "default" in cells else -1
                continue
            if column < 1 or set(cells[0]) <= {"-", ":"} or len(cells) <= column:
                continue
            names, prefix = [], ""
            for name in re.findall(r"`(FRAUD_[A-Z0-9_]+|_[A-Z0-9_]+)`", cells[0]):
                if name.startswith("FRAUD_"):
                    prefix = name.rsplit("_", 1)[0]  # `FRAUD_TOPIC_TRANSACTIONS`, `_DECISIONS`, ...
                names.append(name if name.startswith("FRAUD_") else prefix + name)
            names = [n for n in names if n.lower()[6:] in Settings.model_fields]
            values = [v.strip() for v in cells[column].split(" / ")]
            if len(values) != len(names):
                values = [v.strip() for v in cells[column].split(", ")]
            if len(values) != len(names):
                values = [cells[column]] * len(names)  # one value for every name in the cell
            for name, value in zip(names, values, strict=True):
                yield _rel(path), name, value


def test_every_default_a_docs_table_states_is_the_settings_default() -> None:
    found = list(_table_defaults())
    assert len(found) > 60  # configuration.md's tables are read
    wrong = [f"{where}: {name} = {value!r}, Settings: {_default(name)!r}" for where, name, value in found
             if not _same(_parse(value, name.lower()), _default(name))]  # fmt: skip
    assert not wrong, "\n".join(wrong)


#: `FRAUD_X` (25 ms) / (`FRAUD_X`, 150 ms ...) / `FRAUD_X` (1,200 records ...): a default quoted in prose.
_PROSE_DEFAULT = re.compile(r"`(FRAUD_[A-Z0-9_]+)`(?:,| \(|: ) ?(\d[\d,]*(?:\.\d+)?)(?: ?(ms|s|days|KiB)\b)?")


def test_every_default_quoted_in_prose_is_the_settings_default() -> None:
    wrong, seen = [], 0
    for path in DOCS:
        for match in _PROSE_DEFAULT.finditer(_outside_bench_blocks(path.read_text())):
            name, number, unit = match.groups()
            field = name.removeprefix("FRAUD_").lower()
            if field not in Settings.model_fields:
                continue
            seen += 1
            value = _number(number, unit, field)
            if value != float(_default(name)):
                wrong.append(f"{_rel(path)}: {match.group(0)!r}, Settings: {_default(name)!r}")
    assert seen > 5
    assert not wrong, "\n".join(wrong)


def test_variables_the_settings_refuse_are_not_documented_as_accepted() -> None:
    """Every FRAUD_* name the docs mention is a setting or one of the variables
    the settings let through; anything else stops every command (exit 2)."""
    from app.settings import OTHER_VARIABLES

    fields = {f"FRAUD_{name.upper()}" for name in Settings.model_fields}
    unknown: dict[str, str] = {}
    for path in DOCS:
        # The refusal's own example is not a name the docs offer; a bench block records the
        # settings of the run it shows, which may predate a setting's removal.
        text = re.sub(r"`FRAUD_\w+\s+\(did you mean", "", _outside_bench_blocks(path.read_text()))
        for name in re.findall(r"\bFRAUD_[A-Z0-9_]*[A-Z0-9]\b", text):
            if name not in fields and name not in OTHER_VARIABLES and not any(f.startswith(name + "_") for f in fields):
                unknown.setdefault(name, _rel(path))
    assert not unknown, f"named in the docs but refused by every command: {unknown}"


# --- module paths -----------------------------------------------------------------------------------------------

_TOP = "app|agents|pipeline|models|gateway|tools|bench|tests|scripts|config|deploy|proto|docs"
_PATH = re.compile(rf"(?<![\w./-])((?:{_TOP})/[\w./-]*[\w/])")
#: Paths that exist only once something ran (the model registry, a stack's folder).
_RUNTIME = ("models/registry", "config/decision-key", "config/decision-public-keys.json", "config/client-keys.json",
            "config/gateway-keys.json", "config/gateway-analyst-keys.json")  # fmt: skip


def test_every_module_path_the_docs_name_exists() -> None:
    missing = []
    for path in DOCS:
        text = path.read_text()
        for match in _PATH.finditer(text):
            if "<" in re.split(r"[\s`)]", text[match.end() :], maxsplit=1)[0]:  # a pattern: `training-<rows>.json`
                continue
            token = match.group(1).rstrip(".")
            if not token.startswith(_RUNTIME) and not (REPO / token).exists():
                missing.append(f"{_rel(path)}: {token}")
        for module in re.findall(rf"python -m ((?:{_TOP})(?:\.[a-z_]+)+)", text):  # the project's own
            as_path = REPO / module.replace(".", "/")
            if not (as_path.with_suffix(".py").is_file() or (as_path / "__main__.py").is_file()):
                missing.append(f"{_rel(path)}: python -m {module}")
    assert not missing, "\n".join(missing)


def _product_modules() -> set[str]:
    out = set()
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            rel = _rel(path)
            if "/grpc_gen/" in rel or rel == f"{package}/__init__.py":
                continue
            out.add(rel)
    return out


def _architecture_modules() -> set[str]:
    """The paths docs/architecture.md's module tree names (``pkg/`` lines, entries
    indented 2 under them, a subpackage's indented 4)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## Modules", 1)[1].split("```", 2)[1]
    named, package, sub = set(), "", ""
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = re.findall(r"^[^\s,]+(?:, [^\s,]+)*", line.strip())[0]
        if indent == 0:
            package, sub = first.rstrip("/"), ""
            continue
        if indent > 4:  # a description continued
            continue
        for name in first.split(", "):
            if indent == 2:
                sub = name.rstrip("/") if name.endswith("/") else ""
                named.add(f"{package}/{name}".rstrip("/"))
            else:
                named.add(f"{package}/{sub}/{name}")
    return named


def test_architecture_names_every_product_module_and_only_modules_that_exist() -> None:
    named = _architecture_modules()
    assert not [n for n in named if not (REPO / n).exists()], "named but missing"
    unnamed = sorted(_product_modules() - named)
    assert not unnamed, f"docs/architecture.md's module tree lacks: {unnamed}"


def test_the_readme_layout_names_every_module_of_each_product_package() -> None:
    text = (REPO / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    package = ""
    for line in block.splitlines():
        if re.match(r"^\w+/", line):
            package = line.split("/", 1)[0]
        entries[package] = entries.get(package, "") + " " + line
    missing = []
    for module in sorted(_product_modules()):
        package, rest = module.split("/", 1)
        name = rest.split("/", 1)[0].removesuffix(".py") + ("/" if "/" in rest else "")
        if not re.search(rf"(?<![\w/]){re.escape(name)}(?![\w])", entries.get(package, "")):
            missing.append(module)
    assert not missing, f"README.md's layout lacks: {missing}"
    for package in PRODUCT:  # and every name in it with an underscore or a slash is a module
        listed = re.sub(r"\(.*?\)", "", entries[package].split("/", 1)[1])
        for name in re.findall(r"\b[a-z]+_[a-z_]+\b|\b[a-z_]+/", listed):
            stem = name.rstrip("/")
            assert (REPO / package / stem).is_dir() or (REPO / package / f"{stem}.py").is_file(), f"{package}/{name}"


# --- Redis ACLs -------------------------------------------------------------------------------------------------


def _allow_list() -> dict[str, set[str]]:
    """SECURITY.md's Redis users table: role -> commands (``SCRIPT LOAD`` -> ``script|load``)."""
    text = (REPO / "SECURITY.md").read_text().split("## Redis users", 1)[1]
    table = text.split("| user | commands |", 1)[1].split("\n\n", 1)[0]
    out: dict[str, set[str]] = {}
    for line in table.splitlines()[2:]:
        user, commands = (c.strip() for c in line.strip().strip("|").split("|"))
        names = {c.lower().replace(" ", "|") for c in re.findall(r"`([A-Z]+(?: [A-Z]+)?)`", commands)}
        out[user.strip("`")] = names
    return out


def test_security_md_lists_each_redis_users_allow_list_as_the_code_sets_it() -> None:
    table = _allow_list()
    everyone = table.pop("every role")
    assert set(table) == {"worker", "gateway", "materialize"}
    for role, commands in table.items():
        assert commands | everyone == set(acl_commands(role)), role
