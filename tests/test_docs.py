"""The README and docs/ against the code: short enough to read, pointing at things that exist.

Docs drift silently: a renamed module, a removed config key or a moved function keeps being
named in prose long after it is gone. These checks read README.md and docs/*.md and fail on:

- a README over 250 lines, one whose first code block is not the two set-up commands, or whose
  map leaves out a package of src/ or links a topic page that does not exist;
- a commit hash or one of our issue numbers (they belong in git history);
- a file path (`*.py`, `src/…`, `conf/…`, `scripts/…`, `tests/…`, `docs/…`) that does not exist;
- a dotted Python name (`hydra_ddp.x.y`, or `loop.fit`, `tracking.Sink`: a name under the
  package) that does not import;
- a key of the template's typed groups (`trainer.*`, `dist.*`, `ddp.*`, `logger.*`) that the
  schema does not have;
- a class named in backticks (`CamelCase`) that src/ does not define, unless it is one of the
  libraries' names listed below.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

from hydra_ddp.config import DDPConfig, DistConfig, TrainerConfig
from hydra_ddp.logger_config import LoggerConfig

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "hydra_ddp"
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
TEXTS = [README, *PAGES]

# Names of torch, Hydra, W&B, Ray and friends that the docs talk about.
LIBRARY_CLASSES = set(
    """
    AutoModel AutoModelForCausalLM BatchEncoding ChildFailedError ConfigStore DTensor DataLoader
    Dataset DistributedDataParallel DistributedSampler EventAccumulator FileSystemReader
    FileSystemWriter FullyShardedDataParallel GPT2Config GPT2LMHeadModel GradScaler
    KeyboardInterrupt MedianPruner PreTrainedModel ReduceLROnPlateau SignalException StepLR
    SuccessiveHalvingPruner SyncBatchNorm TrialState UncompletedJobError ValueError AdamW SGD
    EnforceNotMet OSError RuntimeError TypeError KeyError NotADirectoryError PermissionError
    FileNotFoundError TimeoutError Module Linear Sequential Flatten ReLU BatchNorm1d BatchNorm2d
    LayerNorm Embedding Tensor CosineAnnealingLR LambdaLR PowerSGDState DefaultSavePlanner Enum
    MISSING DictConfig ListConfig BaseSweeper Launcher Process PyTorch OmegaConf
    ZeroRedundancyOptimizer TensorBoard GitHub OpenBLAS DeepSpeed Lightning
    TorchDistributedEnvironment GraceTime KillWait NopPruner VmHWM
    """.split()
)
# Typos the docs show being refused, on purpose.
WRONG_ON_PURPOSE = {"trainer.batchsize", "trainer.fast_dev_run", "model.widht"}
# Example files of a user's, named in the docs as what the user writes.
USER_FILES = re.compile(r"^(my_\w+|mine|wide|myproj\w*)\.(py|yaml)$")
# Output files a job writes, and files of other projects the docs cite.
NOT_OURS = set("multigpu_torchrun.py _impl.py setup.py conftest.py __init__.py".split())
TYPED = {
    "trainer": TrainerConfig,
    "dist": DistConfig,
    "ddp": DDPConfig,
    "logger": LoggerConfig,
}


def _code_spans(text: str) -> list[str]:
    """Inline code and the lines of fenced code blocks."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        spans.extend(block.splitlines())
    return spans


@cache
def _defined_in_src() -> frozenset[str]:
    names = set()
    for path in [*SRC.parent.rglob("*.py"), *(REPO / "scripts").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(names)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _typed_key(dotted: str) -> bool | None:
    """True/False for a key of a typed group (its first nested level); None if not one."""
    group, _, rest = dotted.partition(".")
    if group not in TYPED or not rest:
        return None
    return rest.split(".")[0] in {f.name for f in dataclasses.fields(TYPED[group])}


@cache
def _component_keys(group: str) -> frozenset[str]:
    """Keys the YAML files of a component group (or an experiment) set, at any depth."""
    keys = set()
    for path in [*(REPO / "conf" / group).glob("*.yaml"), *(REPO / "conf/experiment").glob("*")]:
        keys.update(re.findall(r"^\s*([\w]+):", path.read_text(), flags=re.M))
    return frozenset(keys)


def _file_exists(token: str) -> bool:
    token = token.rstrip("/").strip("'\"")
    if token.startswith(("src/", "conf/", "scripts/", "tests/", "docs/", ".ci/")):
        return (REPO / token).exists()
    if "/" in token:  # package-relative: loop/fit.py, checkpoint/state.py, hydra_ddp/x.py
        rel = token.removeprefix("hydra_ddp/")
        return (SRC / rel).exists() or (REPO / "conf" / rel).exists()
    return any(any((REPO / top).rglob(token)) for top in ("src", "scripts", "tests"))


FILE_SUFFIXES = (".py", ".yaml", ".md", ".json", ".jsonl", ".sh", ".pt", ".dcp", ".log")


def _problems(path: Path) -> list[str]:
    text = path.read_text()
    found = []
    # Prose too: "loop.py's `train`" names a file as surely as a code span does.
    prose = re.sub(r"https?://\S+", "", text)
    for span in [*_code_spans(text), *re.findall(r"(?<![\w/.-])[\w/.-]+\.py\b", prose)]:
        for token in re.findall(r"[\w./-]+\.py\b|\b(?:src|conf|scripts|tests|docs)/[\w./-]+", span):
            name = token.rsplit("/", 1)[-1]
            if "<" in token or "*" in token or USER_FILES.match(name) or token in NOT_OURS:
                continue
            if token.startswith(("outputs/", "multirun/")) or not _file_exists(token):
                if not token.startswith(("outputs/", "multirun/")):
                    found.append(f"file {token}")
        for dotted in re.findall(r"(?<![\w./-])([a-z_][a-z0-9_]*(?:\.[A-Za-z_]\w*)+)", span):
            if dotted in WRONG_ON_PURPOSE or "._target_" in dotted or dotted.endswith("._target_"):
                continue
            if dotted.endswith(FILE_SUFFIXES):  # a file's name (train.log), not a module's name
                continue
            head = dotted.split(".")[0]
            typed = _typed_key(dotted)
            if typed is True:
                continue
            if typed is None and (REPO / "conf" / head).is_dir():
                key = dotted.split(".")[1]
                if key in _component_keys(head) or _resolves(f"hydra_ddp.{dotted}"):
                    continue
            if head == "hydra_ddp":
                if not _resolves(dotted):
                    found.append(f"name {dotted}")
            elif (SRC / head).is_dir() or (SRC / f"{head}.py").exists():
                if not _resolves(f"hydra_ddp.{dotted}") and typed is None:
                    found.append(f"name {dotted}")
            if typed is False and not _resolves(f"hydra_ddp.{dotted}"):
                found.append(f"config key {dotted}")
        for cls in re.findall(r"^([A-Z][a-z]+(?:[A-Z][a-z0-9]*)+)$", span.strip()):
            if cls not in _defined_in_src() and cls not in LIBRARY_CLASSES:
                found.append(f"class {cls}")
    return sorted(set(found))


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_docs_name_only_what_exists(path):
    assert _problems(path) == [], f"{path.name} names what does not exist"


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_no_commit_hashes_or_issue_numbers(path):
    text = re.sub(r"\[[^\]]*\]\(https?://[^)]*\)", "", path.read_text())  # upstream links
    hashes = [
        h
        for h in re.findall(r"\b(?:commit|at|before|after)\s+([0-9a-f]{7,40})\b", text)
        + re.findall(r"\b([0-9a-f]{7,40})\b", text)
        if re.search(r"[0-9]", h) and re.search(r"[a-f]", h)
    ]
    issues = re.findall(r"\b[Ii]ssues? #?\d+|(?<![\w/])#\d+\b", text)
    assert not hashes and not issues, f"{path.name}: {sorted(set(hashes))} {issues}"


def test_readme_is_a_front_door():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert "torchrun --standalone --nproc_per_node=2 -m hydra_ddp.train" in first_block
    assert "python -m pytest" in first_block
    # The map comes on the first two screens (~120 lines) and names every package of src/.
    map_at = next(i for i, line in enumerate(lines) if line.startswith("## Map of the code"))
    assert map_at < 120
    the_map = "\n".join(lines[map_at : map_at + 60])
    packages = [p.name for p in SRC.iterdir() if (p / "__init__.py").exists()]
    assert packages and all(f"{name}/" in the_map for name in packages), packages
    # Every topic page it links exists, and every page of docs/ is linked.
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", text))
    assert linked and all((REPO / "docs" / name).exists() for name in linked)
    unlinked = {p.name for p in PAGES} - linked - {"bench_sampler_index.md", "wandb_resume.md"}
    assert not unlinked, f"docs pages the README does not link: {sorted(unlinked)}"


def test_the_checks_catch_drift(tmp_path, monkeypatch):
    """The checker itself: each kind of stale name, planted in a page, is reported."""
    page = tmp_path / "page.md"
    page.write_text(
        "`config.LoggerBackend` and loop/loop.py's `train`, `trainer.no_such_key`,\n"
        "`hydra_ddp.distributed.no_such_function`, `src/hydra_ddp/gone.py`, `NoSuchClass`,\n"
        "but `trainer.max_steps`, `loop/fit.py`, `hydra_ddp.loop.fit.fit` and `DistEnv` exist.\n"
    )
    assert _problems(page) == [
        "class NoSuchClass",
        "config key trainer.no_such_key",
        "file loop/loop.py",
        "file src/hydra_ddp/gone.py",
        "name config.LoggerBackend",
        "name hydra_ddp.distributed.no_such_function",
    ]
