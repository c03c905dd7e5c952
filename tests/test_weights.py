"""Checkpoint loading and writing: every HF layout, the canonical writer, and bad inputs."""

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from gptj.config import GPTJConfig
from gptj.errors import CheckpointError, ConfigError, GptjError
from gptj.weights.io import convert, expected_shapes, load_model, random_state_dict, save_checkpoint

CFG = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=128)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(transformers.GPTJConfig(**CFG.to_hf_dict())).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def hf_state_dict(model):
    return {k: v.clone() for k, v in model.state_dict().items() if not k.endswith(("attn.bias", "masked_bias"))}


def write_config(d: Path, cfg: GPTJConfig = CFG) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(cfg.to_json_string())


def write_sharded(d: Path, sd: dict, n: int, fmt: str) -> None:
    names = list(sd)
    weight_map = {}
    for i in range(n):
        part = {k: sd[k].contiguous() for k in names[i::n]}
        fname = f"model-{i + 1:05d}-of-{n:05d}.{fmt}"
        if fmt == "safetensors":
            save_file(part, str(d / fname))
        else:
            torch.save(part, d / fname)
        weight_map.update(dict.fromkeys(part, fname))
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (d / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


IDS = torch.tensor([[15496, 995, 11, 428, 318, 257]])


@pytest.mark.parametrize("layout", ["safetensors", "sharded-safetensors", "bin", "sharded-bin", "bin-with-legacy"])
def test_every_hf_layout_loads_with_hf_logits(tmp_path, hf_model, layout):
    sd = hf_state_dict(hf_model)
    write_config(tmp_path)
    if layout == "safetensors":
        save_file(sd, str(tmp_path / "model.safetensors"))
    elif layout == "bin":
        torch.save(sd, tmp_path / "pytorch_model.bin")
    elif layout == "bin-with-legacy":  # old HF checkpoints saved the causal mask buffers
        legacy = {f"transformer.h.{i}.attn.bias": torch.ones(1, 1, 8, 8, dtype=torch.bool) for i in range(2)}
        legacy |= {f"transformer.h.{i}.attn.masked_bias": torch.tensor(-1e9) for i in range(2)}
        torch.save(sd | legacy, tmp_path / "pytorch_model.bin")
    else:
        write_sharded(tmp_path, sd, 3, layout.split("-")[1])
    model = load_model(tmp_path)
    want = logits(hf_model, IDS)  # float32 in another summation order: 1e-4 of the largest logit (test_model)
    torch.testing.assert_close(logits(model, IDS), want, rtol=0, atol=1e-4 * float(want.abs().max()))


def test_hf_saved_directory_loads(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path)
    want = logits(hf_model, IDS)
    torch.testing.assert_close(logits(load_model(tmp_path), IDS), want, rtol=0, atol=1e-4 * float(want.abs().max()))


def test_hf_loads_what_gptj_writes(tmp_path, hf_model):
    out = save_checkpoint(hf_state_dict(hf_model), CFG, tmp_path / "ckpt", max_shard_bytes=4 * 1024**2)
    assert (out / "model.safetensors.index.json").exists()  # small shards: the sharded form is written
    reloaded = transformers.GPTJForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(reloaded, IDS), logits(hf_model, IDS))  # the same weights through the same code
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode("Hello world") == [15496, 995]


def test_convert_hf_to_bfloat16(tmp_path, hf_model):
    src = tmp_path / "src"
    hf_model.save_pretrained(src)
    out = convert(src, tmp_path / "out", dtype=torch.bfloat16)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["model_type"] == "gptj"
    model = load_model(out, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, hf_model.lm_head.weight.to(torch.bfloat16))


def test_random_init_is_deterministic():
    a, b = random_state_dict(CFG, seed=3), random_state_dict(CFG, seed=3)
    c = random_state_dict(CFG, seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert set(a) == set(expected_shapes(CFG))


# --- bad inputs: a clear error naming the problem, and nothing half-written ---------


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def broken_checkpoint(tmp_path, hf_model, how):
    src = tmp_path / "src"
    write_config(src)
    sd = hf_state_dict(hf_model)
    if how == "missing":
        del sd["transformer.h.1.mlp.fc_out.bias"]
    elif how == "shape":
        sd["transformer.h.0.attn.q_proj.weight"] = torch.zeros(64, 32)
    elif how == "nan":
        sd["transformer.h.1.ln_1.weight"][3] = float("nan")
    elif how == "unexpected":
        sd["transformer.h.0.attn.rotary.weight"] = torch.zeros(2)
    save_file(sd, str(src / "model.safetensors"))
    if how == "truncated":
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    return src


@pytest.mark.parametrize("how, message", [
    ("missing", "missing tensor transformer.h.1.mlp.fc_out.bias"),
    ("shape", r"transformer.h.0.attn.q_proj.weight has shape \[64, 32\], expected \[64, 64\]"),
    ("nan", "transformer.h.1.ln_1.weight has NaN"),
    ("unexpected", "unexpected tensor transformer.h.0.attn.rotary.weight"),
    ("truncated", "model.safetensors: not a readable safetensors file"),
])
def test_bad_checkpoint_is_refused_and_nothing_written(tmp_path, hf_model, how, message):
    src = broken_checkpoint(tmp_path, hf_model, how)
    with pytest.raises(CheckpointError, match=message):
        load_model(src)
    with pytest.raises(CheckpointError, match=message):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("container", ["zip", "legacy-pickle"])
def test_malicious_pickle_is_refused(tmp_path, monkeypatch, container):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path / "ckpt")
    payload = {"lm_head.weight": Exploit()}
    if container == "zip":  # torch.save's format, as real pytorch_model.bin files are
        torch.save(payload, tmp_path / "ckpt" / "pytorch_model.bin")
    else:
        with open(tmp_path / "ckpt" / "pytorch_model.bin", "wb") as f:
            pickle.dump(payload, f)
    with pytest.raises(CheckpointError, match="pytorch_model.bin: refusing to load"):
        load_model(tmp_path / "ckpt")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("config, message", [
    ({"model_type": "gpt2", "n_embd": 64}, "not a GPT-J config"),
    ({"model_type": "gptj", "n_embd": 64, "n_head": 5}, "divisible"),
    ({"model_type": "gptj", "activation_function": "relu"}, "activation_function"),
    ("{not json", "invalid JSON"),
])
def test_bad_config_is_refused(tmp_path, config, message):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_model(d)


def test_missing_paths_and_formats(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="neither an HF GPT-J directory"):
        load_model(tmp_path)
    write_config(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path / "empty")


def test_index_cannot_point_outside_the_directory(tmp_path, hf_model):
    d = tmp_path / "ckpt"
    write_config(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))
    with pytest.raises(CheckpointError, match="plain file name"):
        load_model(d)


def test_save_refuses_to_overwrite_without_force(tmp_path):
    sd = random_state_dict(CFG)
    save_checkpoint(sd, CFG, tmp_path / "m")
    with pytest.raises(GptjError, match="already exists"):
        save_checkpoint(sd, CFG, tmp_path / "m")
    save_checkpoint(random_state_dict(CFG, seed=1), CFG, tmp_path / "m", overwrite=True)
    assert not torch.equal(load_model(tmp_path / "m").lm_head.weight, sd["lm_head.weight"])
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_is_exact(dtype):
    from gptj.weights.finite import all_finite

    t = torch.ones(1000, dtype=dtype)
    assert all_finite(t)
    big = torch.full((1000,), torch.finfo(dtype).max / 2, dtype=dtype)  # the sum overflows, values are finite
    assert all_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[517] = bad
        assert not all_finite(u)


# --- progress: big models show bars on a terminal's stderr; stdout stays clean --------------------


def test_auto_progress_only_for_big_models_on_a_terminal(monkeypatch):
    import sys

    from gptj.config import get_preset
    from gptj.weights import io

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert io.auto_progress(get_preset("gptj-6b")) and not io.auto_progress(get_preset("small"))
    assert not io.auto_progress(get_preset("gptj-6b"), False) and io.auto_progress(get_preset("tiny"), True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not io.auto_progress(get_preset("gptj-6b"))


def test_init_load_and_prepare_draw_bars_on_stderr(tmp_path, monkeypatch, capsys):
    """What gptj-6b does on a terminal, shown on tiny by lowering the size threshold."""
    import sys

    from gptj.cli import main
    from gptj.kernels import prepare_for_serving
    from gptj.weights import io

    monkeypatch.setattr(io, "PROGRESS_MIN_PARAMS", 0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["init", "--preset", "tiny", "--dtype", "bfloat16", "--out", str(tmp_path / "m")]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and out.startswith("wrote tiny")  # stdout: the one line
    assert "generating" in err and "writing" in err
    model = load_model(tmp_path / "m", dtype=torch.bfloat16)
    prepare_for_serving(model, "auto", max_rows=1)
    out, err = capsys.readouterr()
    assert out == "" and "loading" in err and "preparing kernels" in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # not a terminal: silent
    prepare_for_serving(load_model(tmp_path / "m", dtype=torch.bfloat16), "auto", max_rows=1)
    assert capsys.readouterr() == ("", "")


# --- hostile config.json beside real weights (issue 16, item 1) ----------------------------------------


@pytest.fixture(scope="module")
def saved_ckpt(tmp_path_factory):
    """CFG's random weights, one model.safetensors, as gptj writes them."""
    out = tmp_path_factory.mktemp("saved") / "m"
    return save_checkpoint(random_state_dict(CFG), CFG, out, with_tokenizer=False)


def with_config(tmp_path: Path, src: Path, changes: dict, name: str = "hostile") -> Path:
    """A checkpoint folder holding src's weights (hard-linked: a symbolic link out of a model folder
    is refused) and its config.json with `changes`."""
    d = tmp_path / name
    d.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            os.link(f, d / f.name)
    (d / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | changes))
    return d


def cli(args: list[str], capsys) -> tuple[int, str]:
    from gptj.cli import main

    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


HOSTILE = [  # config.json changes -> the field the one-line error names
    ({"n_layer": 10**9}, r"'n_layer'"),
    ({"n_positions": 10**10}, r"'n_positions'"),
    ({"eos_token_id": 10**9}, r"'eos_token_id'"),
    ({"eos_token_id": -1}, r"'eos_token_id'"),
    ({"eos_token_id": "x"}, r"'eos_token_id'"),
    ({"n_head": 3}, r"'n_embd' \(64\) must be divisible by n_head \(3\)"),
    ({"n_layer": True}, r"'n_layer'"),
    ({"n_head": 4.0}, r"'n_head'"),
    ({"n_layer": 3}, r"'n_layer' is 3 but the checkpoint holds 2 layers \(model.safetensors\)"),
    ({"n_layer": 1}, r"'n_layer' is 1 but the checkpoint holds 2 layers \(model.safetensors\)"),
]


@pytest.mark.parametrize("changes, message", HOSTILE)
def test_hostile_config_is_one_line_naming_the_field(tmp_path, saved_ckpt, capsys, monkeypatch, changes, message):
    """load_model, `gptj generate` and `gptj convert` refuse it before building or allocating anything."""
    from gptj.models import gptj as gptj_model
    from gptj.weights import io

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(io, "model_from_state_dict", refuse)  # validation comes first: nothing is built
    monkeypatch.setattr(gptj_model, "build_model", refuse)
    monkeypatch.setattr(io, "checked_state_dict", refuse)  # ... and no weight is read
    d = with_config(tmp_path, saved_ckpt, changes)
    config_json = str(d / "config.json")
    with pytest.raises(GptjError, match=message) as e:
        load_model(d)
    assert str(e.value).startswith(f"{config_json}: config field") and "\n" not in str(e.value)
    for args in (["generate", "--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "1"],
                 ["convert", d, "--out", tmp_path / "out"]):
        code, err = cli(args, capsys)
        assert code == 1, err
        assert err.count("\n") == 1 and config_json in err and re.search(message, err), err
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hostile"]


@pytest.mark.parametrize("n_layer", [1, 3])
def test_n_layer_is_checked_against_a_sharded_index(tmp_path, hf_model, n_layer):
    """A sharded checkpoint's index names its layers: a config claiming more or fewer is refused at once."""
    d = tmp_path / "sharded"
    write_config(d, CFG.replace(n_layer=n_layer))
    write_sharded(d, hf_state_dict(hf_model), 3, "safetensors")
    with pytest.raises(ConfigError, match=rf"'n_layer' is {n_layer} but the checkpoint holds 2 layers "
                                          r"\(model.safetensors.index.json\)"):
        load_model(d)


def test_n_layer_1e9_cannot_exhaust_memory(tmp_path, saved_ckpt):
    """The reproduction: `gptj generate` on n_layer 10^9, under a 4 GB address-space limit (the unfixed
    code grows until MemoryError there, exit 2, instead of spinning for minutes unbounded)."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    d = with_config(tmp_path, saved_ckpt, {"n_layer": 10**9})
    r = subprocess.run([sys.executable, "-m", "gptj.cli", "generate", "--model", str(d), "--prompt-ids", "1,2",
                        "--max-new-tokens", "1"], capture_output=True, text=True, preexec_fn=limit)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "'n_layer'" in r.stderr, r.stderr


# --- every file read under a model folder stays inside it (issue 55, item 7) -----------------------


def copied(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def moved_out(folder: Path, name: str, outside: Path) -> Path:
    """Move folder/name to `outside` and leave a symbolic link to it in its place."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    os.replace(folder / name, outside)
    (folder / name).symlink_to(outside)
    return folder / name


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_model_file_linked_out_of_its_folder_is_refused(tmp_path, saved_ckpt, capsys, name):
    """config.json (or the weights) a link to a file outside the folder: refused in one line naming
    it, though the file it points to is a valid one (without the check the model loads)."""
    d = copied(saved_ckpt, tmp_path / "m")
    link = moved_out(d, name, tmp_path / "elsewhere" / name)
    with pytest.raises(GptjError) as e:
        load_model(d)
    msg = str(e.value)
    assert msg.startswith(f"{link}: leaves the model folder") and "\n" not in msg, msg
    code, err = cli(["generate", "--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "1"], capsys)
    assert code == 1 and err.count("\n") == 1 and f"{link}: leaves the model folder" in err, err
    code, err = cli(["convert", d, "--out", tmp_path / "out"], capsys)
    assert code == 1 and "leaves the model folder" in err and not (tmp_path / "out").exists(), err


def test_a_shard_and_an_index_linked_out_are_refused(tmp_path, hf_model):
    d = tmp_path / "sharded"
    write_config(d, CFG)
    write_sharded(d, hf_state_dict(hf_model), 3, "safetensors")
    load_model(d)  # whole, it loads
    shard = sorted(d.glob("model-*.safetensors"))[1]
    link = moved_out(d, shard.name, tmp_path / "elsewhere" / shard.name)
    with pytest.raises(GptjError, match=rf"^{re.escape(str(link))}: leaves the model folder"):
        load_model(d)
    os.replace(tmp_path / "elsewhere" / shard.name, shard)  # the shard back; now the index leaves
    link = moved_out(d, "model.safetensors.index.json", tmp_path / "elsewhere" / "index.json")
    with pytest.raises(GptjError, match=rf"^{re.escape(str(link))}: leaves the model folder"):
        load_model(d)


def test_links_inside_the_folder_are_followed(tmp_path, saved_ckpt):
    """A link to another file inside the folder (as the HF hub cache's snapshots are made of, there
    into its blobs/ folder) loads as the file itself."""
    d = copied(saved_ckpt, tmp_path / "m")
    (d / "blobs").mkdir()
    for name in ("config.json", "model.safetensors"):
        os.replace(d / name, d / "blobs" / name)
        (d / name).symlink_to(Path("blobs") / name)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(logits(load_model(d), ids), logits(load_model(saved_ckpt), ids))


def test_a_tokenizer_linked_out_is_refused(tmp_path, saved_ckpt):
    from gptj.tokenizer import load_tokenizer, tokenizer_for_model

    d = copied(saved_ckpt, tmp_path / "m")
    load_tokenizer().save(tmp_path / "elsewhere")
    (d / "tokenizer.json").symlink_to(tmp_path / "elsewhere" / "tokenizer.json")
    for read in (tokenizer_for_model, load_tokenizer):
        with pytest.raises(GptjError, match=rf"^{re.escape(str(d / 'tokenizer.json'))}: leaves the model folder"):
            read(d)
    assert load_tokenizer(tmp_path / "elsewhere" / "tokenizer.json").vocab_size == 50400  # a file named: read


def test_a_slim_checkpoint_shard_linked_out_is_refused(tmp_path):
    import numpy as np

    d = tmp_path / "slim"
    d.mkdir()
    (tmp_path / "elsewhere").mkdir()
    np.savez(tmp_path / "elsewhere" / "0.npz", np.zeros(2, dtype=np.float32))
    (d / "shard_0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(GptjError, match=rf"^{re.escape(str(d / 'shard_0' / '0.npz'))}: leaves the model folder"):
        load_model(d, config=CFG)


def test_serving_a_folder_with_a_file_linked_out_is_a_400(tmp_path, saved_ckpt):
    """The admin API's root check covers the folder; the loaders' check covers its files."""
    import urllib.error
    import urllib.request

    from serve_util import server_thread

    root = tmp_path / "root"
    good = copied(saved_ckpt, root / "good")
    bad = copied(saved_ckpt, root / "bad")
    moved_out(bad, "config.json", tmp_path / "outside" / "config.json")
    with server_thread({"good": good}, admin_token="adm", model_root=str(root)) as server:
        req = urllib.request.Request(server.url + "/admin/models", method="POST",
                                     data=json.dumps({"name": "bad", "path": str(bad)}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer adm"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=120)
        body = json.loads(e.value.read())
        assert e.value.code == 400 and "leaves the model folder" in body["error"]["message"], body
        with urllib.request.urlopen(server.url + "/v1/models", timeout=60) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["good"]


# --- a full disk while writing a model (issue 55, item 6) ------------------------------------------


def full_disk_in_save_file(monkeypatch, module) -> None:
    """`module`'s safetensors save_file writes half a file, then fails as safetensors does on a full disk."""
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(module, "save_file", save_file)


@pytest.mark.parametrize("command", ["init", "init --force", "convert"])
def test_a_full_disk_while_writing_a_model_is_one_line_and_leaves_nothing(tmp_path, saved_ckpt, capsys, monkeypatch,
                                                                          command):
    from gptj.weights import io

    out = tmp_path / "out"
    if command == "init --force":  # a model already there stays as it was
        copied(saved_ckpt, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if out.exists() else None
    full_disk_in_save_file(monkeypatch, io)
    args = (["init", "--preset", "tiny", "--out", out] if command.startswith("init")
            else ["convert", saved_ckpt, "--out", out, "--quiet"])
    code, err = cli(args + (["--force"] if command == "init --force" else []), capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert f"{out}: cannot write: no space left on device" in err and "internal error" not in err, err
    after = {p.name: p.read_bytes() for p in out.iterdir()} if out.exists() else None
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if before else [])  # no temporary folder left


def test_tensor_parallel_shards_and_config_linked_out_are_refused(tmp_path, saved_ckpt, capsys):
    """`gptj convert --tp N`'s per-rank files are found for each rank (gptj.weights.io.Checkpoint,
    what gptj.parallel.shards.load_rank loads from): the same rule, before anything is built."""
    from gptj.weights.checkpoint import Checkpoint

    d = tmp_path / "tp"
    code, err = cli(["convert", saved_ckpt, "--out", d, "--tp", "2", "--quiet"], capsys)
    assert code == 0, err
    shard = moved_out(d, "tp2/rank1.safetensors", tmp_path / "elsewhere" / "rank1.safetensors")
    with pytest.raises(GptjError, match=rf"^{re.escape(str(shard))}: leaves the model folder"):
        Checkpoint.read(d, 1, 2)
    link = moved_out(d, "config.json", tmp_path / "elsewhere" / "config.json")
    with pytest.raises(GptjError, match=rf"^{re.escape(str(link))}: leaves the model folder"):
        Checkpoint.read(d, 0, 2)


def test_the_fp8_precheck_reads_no_config_from_outside_the_folder(tmp_path, saved_ckpt):
    """The runtime's fp8 check (what `gptj serve` runs before the loader) reads config.json: a link
    out of the folder is refused there too (without it, the outside file decides what is said: here
    that fp8 needs a GPU)."""
    from gptj.runtime.build import load_model as load_spec
    from gptj.runtime.spec import ModelSpec

    d = copied(saved_ckpt, tmp_path / "m")
    link = moved_out(d, "config.json", tmp_path / "elsewhere" / "config.json")
    link.resolve().write_text(json.dumps(json.loads(link.read_text()) | {"quantization": {"mode": "fp8"}}))
    with pytest.raises(GptjError, match=rf"^{re.escape(str(link))}: leaves the model folder"):
        load_spec(ModelSpec(path=str(d)))


def test_a_calibration_linked_out_is_refused(tmp_path, saved_ckpt):
    """W8A8's smoothing factors (calibration.safetensors) are read from the model folder too."""
    from gptj.weights.io import calibrate

    d = copied(saved_ckpt, tmp_path / "m")
    calibrate(d, [[1, 2, 3, 4], [5, 6, 7]], dataset="test")
    load_model(d, quantize="w8a8")  # in place, it loads
    link = moved_out(d, "calibration.safetensors", tmp_path / "elsewhere" / "calibration.safetensors")
    with pytest.raises(GptjError, match=rf"^{re.escape(str(link))}: leaves the model folder"):
        load_model(d, quantize="w8a8")
    with pytest.raises(GptjError, match=rf"^{re.escape(str(link))}: leaves the model folder"):
        convert(d, tmp_path / "out")  # a calibrated float checkpoint's factors are copied along
    assert not (tmp_path / "out").exists()


def test_an_hf_folders_weight_files_are_found_once_and_loading_streams_from_them(tiny_checkpoint, monkeypatch):
    """Checkpoint.read finds and checks an HF folder's weight files once (its index and every file inside
    the folder) and keeps them; loading reads the tensors from those files without looking again."""
    from gptj.weights import hf
    from gptj.weights.checkpoint import Checkpoint
    from gptj.weights.io import load

    found = []
    real = hf.weight_files
    monkeypatch.setattr(hf, "weight_files", lambda path: found.append(path) or real(path))
    checkpoint = Checkpoint.read(tiny_checkpoint)
    assert found == [Path(tiny_checkpoint)] and checkpoint.files == tuple(real(Path(tiny_checkpoint)))
    model = load(checkpoint)
    assert len(found) == 1
    want = load_model(tiny_checkpoint).state_dict()
    assert all(torch.equal(t, want[name]) for name, t in model.state_dict().items())
