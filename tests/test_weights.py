"""Weights in, a model out (docs/weights.md): `trainer.init_from` of every format people have,
renamed by `trainer.init_map`, with its load line; `python -m hydra_ddp.export`'s folder, as
small as the parameters, loaded strictly in a fresh process that imports only what
`hydra_ddp.export.load` needs; scripts/generate.py sampling from it; `--format hf` round-tripping
a transformers GPT-2; every bad input in one line.

Default: loading on 2 real gloo ranks, whole and fsdp2-sharded, in session-kept workers
(helpers/ranks.py); one small in-process training run to export. Slow: real training jobs on 2
ranks through `trainer.init_from` for every format under DDP and fsdp2, and the HF round trip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, summary, user_env
from helpers import ranks
from helpers.inproc import compose, train_here, train_ranks, typed
from helpers.weights_ranks import META, load_each, write_sharded
from omegaconf import OmegaConf
from safetensors.torch import save_file, save_model

from hydra_ddp import checkpoint
from hydra_ddp.checkpoint.init_from import for_fresh_run
from hydra_ddp.components import build
from hydra_ddp.errors import UserError
from hydra_ddp.export import load, read_config, vocabulary
from hydra_ddp.export.writer import export, main
from hydra_ddp.models import GPT

ROOT = Path(__file__).resolve().parents[1]
ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 64, "dropout": 0.0}
JOB = [*FAST, "data=text", "model=gpt", *(f"model.{k}={v}" for k, v in ARGS.items()),
       "data.block_size=32", "trainer.batch_size=8", "trainer.eval_interval=0"]  # fmt: skip
STRICT_OK = ", 0 missing, 0 unexpected, 0 reshaped-refused tensors"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-step run of the small GPT (its .hydra/config.yaml as the entry writes it), its
    export, and its weights in every format a user may have."""
    root = tmp_path_factory.mktemp("weights")
    run = root / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose(*JOB, "trainer.max_steps=2"), run / ".hydra" / "config.yaml")
    train_here(run, *JOB, "trainer.max_steps=2")
    state = checkpoint.load(checkpoint.latest(run))["model"]
    model = GPT(vocab_size=state["tok.weight"].shape[0], block_size=32, **ARGS)
    model.load_state_dict(state)
    torch.save(state, root / "reference.pt")
    torch.save(state, root / "bare.pt")  # torch.save(model.state_dict())
    (root / "bin").mkdir()
    torch.save(state, root / "bin" / "pytorch_model.bin")
    save_model(model, str(root / "model.safetensors"))  # the tied head stored once
    hf = root / "hf"  # a save_pretrained folder of a model that kept ours as .transformer
    hf.mkdir()
    save_file({f"transformer.{k}": v for k, v in state.items() if k != "head.weight"},
              str(hf / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    partial = dict(state)  # a changed model: one block fewer, a longer context, a new tensor
    for k in [k for k in partial if k.startswith("blocks.1.")]:
        del partial[k]
    partial["pos.weight"] = torch.zeros(48, ARGS["n_embd"])
    partial["extra.weight"] = torch.zeros(3)
    torch.save(partial, root / "partial.pt")
    return {"root": root, "run": run, "export": export(run), "state": root / "reference.pt",
            "checkpoint": checkpoint.latest(run), "hf": hf}  # fmt: skip


def test_every_format_loads_whole_and_into_fsdp2_shards_on_two_ranks(
    made: dict[str, Path],
) -> None:
    """Every format into a whole model and, on 2 gloo ranks, into fully_shard's shards (each
    rank its own slices; a .dcp folder read per shard by DCP), also of a model built on the
    meta device (ddp.meta_init, with init_strict=false too): the weights loaded equal, and the
    load line's counts."""
    root = made["root"]
    sources = {
        "checkpoint": (str(made["checkpoint"]), {}, True),
        "bare": (str(root / "bare.pt"), {}, True),
        "bin": (str(root / "bin" / "pytorch_model.bin"), {}, True),
        "safetensors": (str(root / "model.safetensors"), {}, True),
        "hf": (str(made["hf"]), {"transformer.": ""}, True),
        "export": (str(made["export"]), {}, True),
        "partial": (str(root / "partial.pt"), {}, False),
    }
    vocab = torch.load(made["state"], weights_only=True)["tok.weight"].shape[0]
    args = {"vocab_size": vocab, "block_size": 32, **ARGS}
    out = ranks.run(load_each, sources, args, str(made["state"]), str(root), timeout=180)
    for rank in out:
        assert rank == out[0]  # the same line and values on every rank
    kinds = {"checkpoint": "checkpoint", "bare": "state dict",
             "bin": "state dict", "safetensors": "safetensors", "hf": "Hugging Face",
             "export": "export", "dcp": "checkpoint, sharded"}  # fmt: skip
    for wrapper in ("whole", "fsdp2", "meta"):
        for name, kind in kinds.items():
            if wrapper == "meta" and name not in META:
                continue
            line, diff = out[0][f"{wrapper} {name}"]
            # 29 names; a safetensors file holds the tied head once (28), which still loads it.
            stored = 28 if kind in ("safetensors", "Hugging Face", "export") else 29
            assert f"({kind}): {stored} matched{STRICT_OK}" in line, line
            assert diff == 0.0, (wrapper, name, diff)
        line, diff = out[0][f"{wrapper} partial"]
        assert diff == 0.0
        assert line.endswith(
            "(state dict): 16 matched, 12 missing, 1 unexpected, 1 reshaped-refused tensors; "
            "missing: blocks.1.ln1.weight, blocks.1.ln1.bias, blocks.1.ln2.weight (+9 more); "
            "unexpected: extra.weight; reshaped-refused: pos.weight ([48, 64] in the file, "
            "[32, 64] here)"
        ), line


def test_export_is_its_parameters_loads_strictly_in_a_fresh_process_and_generates(
    made: dict[str, Path],
) -> None:
    """The GPT's export is <= 1.02x its parameters' bytes (its tied embedding once). A fresh
    process loads it with strict=True, importing of this package only what export.load does
    (the loader, and the model's own module), to the checkpoint's logits; then, in the same
    process, scripts/generate.py as a user runs it prints the prompt and 40 sampled characters
    of the exported vocabulary."""
    folder = made["export"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors",
                                                        "vocab.json"]  # fmt: skip
    umask = os.umask(0)
    os.umask(umask)
    # As any file the user writes (safetensors makes its own for its owner only).
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o666 & ~umask}
    config = read_config(folder)
    assert config["model"] == {"_target_": "hydra_ddp.models.GPT", **ARGS}
    assert config["spec"]["block_size"] == 32 and config["hydra_ddp"]["step"] == 2
    param_bytes = sum(p.numel() * p.element_size() for p in load(folder).parameters())
    assert (folder / "model.safetensors").stat().st_size <= 1.02 * param_bytes
    ids, prompt = [list(range(7))], "def "
    script = ROOT / "scripts" / "generate.py"
    code = (
        "import json, runpy, sys, torch\n"
        "import hydra_ddp.export as ex\n"
        "before = sorted(m for m in sys.modules if m.startswith('hydra_ddp'))\n"
        f"model = ex.load({str(folder)!r}, strict=True)\n"
        "after = sorted(m for m in sys.modules if m.startswith('hydra_ddp'))\n"
        f"logits = model(torch.tensor({ids})).tolist()\n"
        "print(json.dumps({'before': before, 'after': after, 'logits': logits}))\n"
        f"sys.argv = [{str(script)!r}, {str(folder)!r}, '--prompt', {prompt!r}, '--tokens', '40']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=user_env(made["root"]), timeout=120, cwd=made["root"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, text = done.stdout.removesuffix("\n").split("\n", 1)
    fresh = json.loads(first)
    assert fresh["before"] == ["hydra_ddp", "hydra_ddp.errors", "hydra_ddp.export",
                               "hydra_ddp.export_format"]  # fmt: skip
    # What load imported: the model's own module (its argument checks are in errors: no Hydra).
    new = set(fresh["after"]) - set(fresh["before"])
    assert new == {"hydra_ddp.models"}, new
    expected = GPT(vocab_size=config["spec"]["vocab_size"], block_size=32, **ARGS)
    expected.load_state_dict(checkpoint.load(made["checkpoint"])["model"])
    with torch.no_grad():
        want = expected.eval()(torch.tensor(ids))
    assert torch.allclose(torch.tensor(fresh["logits"]), want, atol=1e-6)
    assert text.startswith(prompt) and len(text) == len(prompt) + 40, repr(text)
    assert set(text) <= set(vocabulary(folder).tokens)


def test_bad_weights_are_one_line_each(made: dict[str, Path], tmp_path: Path) -> None:
    """A file of another model, a safetensors header that lies, an HF folder with no weights,
    an export folder missing a file: one line each, naming what to do."""
    other = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    with pytest.raises(UserError) as e:
        for_fresh_run(other, str(made["export"]), None)
    line = str(e.value)
    assert "\n" not in line and "does not fit this model" in line and "trainer.init_map" in line
    assert (
        "unexpected: blocks.1.ln1.bias, " in line
        and "reshaped-refused: pos.weight ([32, 64] in" in line
    )
    assert "trainer.resume" not in line
    # A header whose shape claims more bytes than the file holds for the tensor.
    lying = tmp_path / "lying.safetensors"
    data = bytearray((made["root"] / "model.safetensors").read_bytes())
    header = data[8 : 8 + int.from_bytes(data[:8], "little")].decode()
    first = json.loads(header)["blocks.0.ln1.bias"]["shape"]
    data[8 : 8 + len(header)] = header.replace(f"[{first[0]}]", f"[{first[0] * 4}]", 1).encode()
    lying.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"not a readable safetensors file \(its header does"):
        for_fresh_run(other, str(lying), None)
    empty_hf = tmp_path / "hf_no_weights"
    empty_hf.mkdir()
    (empty_hf / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(UserError, match="the folder holds no weights.*save_pretrained"):
        for_fresh_run(other, str(empty_hf), None)
    for gone in ("model.safetensors", "vocab.json", "config.json"):
        broken = tmp_path / f"no_{gone}"
        shutil.copytree(made["export"], broken)
        (broken / gone).unlink()
        with pytest.raises(UserError, match=f"(missing|no) {gone}"):
            load(broken)
    with pytest.raises(UserError, match="export folder missing model.safetensors"):
        for_fresh_run(other, str(tmp_path / "no_model.safetensors"), None)
    no_tensors = tmp_path / "notes.pt"
    torch.save({"lr": 0.1}, no_tensors)
    with pytest.raises(UserError, match="holds no state dict"):
        for_fresh_run(other, str(no_tensors), None)
    # --format hf of a model that is not a transformers one; an unknown argument.
    with pytest.raises(SystemExit) as code:
        main([f"run={made['run']}", "--format", "hf", f"out={tmp_path / 'hf_out'}"])
    assert code.value.code == 2 and not (tmp_path / "hf_out").exists()
    with pytest.raises(SystemExit):
        main([f"run={made['run']}", "--format", "onnx"])


def test_init_map_is_a_mapping_of_prefixes() -> None:
    assert typed('trainer.init_map={transformer.:""}').trainer.init_map == {"transformer.": ""}
    with pytest.raises(UserError, match="trainer.init_map"):
        typed("trainer.init_map=transformer.")


# --------------------------------------------------------------------------------------------
# Real training jobs (slow)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["default", "fsdp2"])
def test_init_from_every_format_through_training_on_two_ranks(
    made: dict[str, Path], wrapper: str, tmp_path: Path
) -> None:
    """trainer.init_from of each format, a 2-rank job with lr 0: the load line's counts, and
    the test loss of the weights loaded, the source run's from every format."""
    root = made["root"]
    vocab = torch.load(made["state"], weights_only=True)["tok.weight"].shape[0]
    args = {"vocab_size": vocab, "block_size": 32, **ARGS}
    ranks.run(write_sharded, args, str(made["state"]), str(tmp_path / "w.dcp"), timeout=120)
    sources = {
        "dcp": (tmp_path / "w.dcp", [], 29),
        "checkpoint": (made["checkpoint"], [], 29),
        "bare": (root / "bare.pt", [], 29),
        "bin": (root / "bin" / "pytorch_model.bin", [], 29),
        "safetensors": (root / "model.safetensors", [], 28),
        "hf": (made["hf"], ['trainer.init_map={transformer.:""}'], 28),
        "export": (made["export"], [], 28),
    }
    losses = {}
    for name, (path, extra, matched) in sources.items():
        done = train_ranks(tmp_path / name, *JOB, f"ddp={wrapper}", "trainer.max_steps=1",
                           "optim.lr=0", f"trainer.init_from={path}", *extra)  # fmt: skip
        line = next(ln for ln in done.logs[0].splitlines() if "trainer.init_from: " in ln)
        assert f"{matched} matched{STRICT_OK}" in line, line
        losses[name] = done[0]["test_loss"]
    # lr 0: every job evaluates the weights it loaded, those the source run ended with.
    for loss in losses.values():
        assert loss == pytest.approx(summary(made["run"])["test_loss"], abs=1e-5), losses


@pytest.mark.slow
def test_hf_gpt2_fine_tuned_from_save_pretrained_round_trips(tmp_path: Path) -> None:
    """A tiny GPT-2 (random init from GPT2Config, nothing downloaded) saved with save_pretrained,
    fine-tuned from that folder on 2 ranks, exported with --format hf: from_pretrained gives
    the checkpoint's logits (1e-6)."""
    transformers = pytest.importorskip("transformers")
    job = [*FAST, "experiment=dict_lm_transformers", "trainer.max_steps=3",
           "trainer.eval_interval=0"]  # fmt: skip
    cfg = typed(*job)
    source = build(cfg.data, "data")
    base = build(cfg.model, "model", **source.spec)
    base.save_pretrained(tmp_path / "base")
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    tuned = [*job, f"trainer.init_from={tmp_path / 'base'}"]
    OmegaConf.save(compose(*tuned), run / ".hydra" / "config.yaml")
    done = train_ranks(run, *tuned)
    line = next(ln for ln in done.logs[0].splitlines() if "trainer.init_from: " in ln)
    assert f"(Hugging Face): {len(base.state_dict()) - 1} matched{STRICT_OK}" in line, line
    out = export(run, format="hf")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    mine = build(cfg.model, "model", **source.spec)
    mine.load_state_dict(checkpoint.load(checkpoint.latest(run))["model"])
    ids = torch.randint(
        0, source.spec["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        got, want = reloaded(input_ids=ids).logits, mine.eval()(input_ids=ids).logits
        untuned = base.eval()(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(got, untuned, atol=1e-3)  # it was fine-tuned
    assert json.loads((out / "config.json").read_text())["hydra_ddp"]["step"] == 3
    assert summary(run)["test_loss"] > 0
