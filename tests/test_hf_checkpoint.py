"""hf_checkpoint.py's checkpoints: loading (sharded, straight into FSDP shards), saving
(transformers reads it back), broken configs and safetensors files refused before any tensor is
read, local paths against hub repo ids, and safe saving: only into save()'s own folder, a crash
leaves the old files whole."""

import fnmatch
import importlib.machinery
import json
import math
import os
import re
import shutil
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import qwen3
from helpers import arange_pos, write_tiny_checkpoint
from lab import hf_checkpoint
from lab.devices import shardings


# --------------------------------------------------------------------------------------------------
# loading and saving
def test_load_variants_agree(tmp_path):
    base = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "a"), tie=False))
    sharded = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "b"), tie=False, shards=3))
    rope = {"rope_theta": 1000000.0, "rope_type": "default"}  # as recent transformers write it
    rope_params = hf_checkpoint.load(
        write_tiny_checkpoint(str(tmp_path / "c"), tie=False, rope_theta=None, rope_parameters=rope)
    )
    assert base.weights["layers"]["q"].shape == (2, 32, 4, 16)
    assert base.weights["layers"]["o"].shape == (2, 4, 16, 32)
    assert base.weights["lm_head"].dtype == jnp.float32
    tokens = jnp.array([[1, 2, 3, 4]])
    logits = [
        qwen3.forward(m.cfg, m.weights, tokens, arange_pos(1, 4))[0]
        for m in (base, sharded, rope_params)
    ]
    np.testing.assert_array_equal(logits[0], logits[1])
    np.testing.assert_array_equal(logits[0], logits[2])
    assert (
        hf_checkpoint.load(str(tmp_path / "a"), dtype=jnp.bfloat16).weights["embed"].dtype
        == jnp.bfloat16
    )


def test_sharded_checkpoint_loads_each_tensor_straight_into_its_shards(tmp_path, monkeypatch):
    """A checkpoint in 3 safetensors files, loaded into train.py's FSDP layout on 4 devices (bf16 on
    disk, float32 in memory): each device holds its shard only, each read returns one shard (never a
    whole split tensor), and the values are those of a plain one-device load."""
    path = write_tiny_checkpoint(str(tmp_path), tie=False, shards=3)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    reads, real = [], jax.make_array_from_callback

    def spy(shape, sharding, read):
        # the blocks read from the file, beside the shape of their tensor
        return real(shape, sharding, lambda i: reads.append((shape, (x := read(i)).shape)) or x)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    placed = hf_checkpoint.load(path, place=lambda shapes: shardings(shapes, mesh)).weights
    monkeypatch.setattr(jax, "make_array_from_callback", real)
    plain = hf_checkpoint.load(path).weights
    split = 0
    for x, y, s in zip(
        jax.tree.leaves(placed),
        jax.tree.leaves(plain),
        jax.tree.leaves(shardings(plain, mesh)),
        strict=True,
    ):
        assert x.sharding == s and x.dtype == jnp.float32
        assert all(b.data.shape == s.shard_shape(x.shape) for b in x.addressable_shards)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        split += not s.is_fully_replicated
    # a vector: read once for the 4 devices; a matrix: in 4 parts
    whole = len(jax.tree.leaves(plain)) - split
    assert split >= 9 and len(reads) == 4 * split + whole
    assert (
        sorted(math.prod(b) * 4 == math.prod(s) for s, b in reads)
        == [False] * whole + [True] * 4 * split
    )


@pytest.mark.parametrize("tie", [True, False])
def test_save_round_trip_and_transformers_reads_it(tmp_path, tie):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src"), tie=tie))
    out = str(tmp_path / "out")
    hf_checkpoint.save(out, m.cfg, m.weights)
    back = hf_checkpoint.load(out)
    assert back.tokenizer is None  # save() writes no tokenizer files
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), m.weights, back.weights))
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = np.array([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        expected = ref(torch.tensor(tokens)).logits.numpy()
    logits, _ = qwen3.forward(m.cfg, m.weights, jnp.array(tokens), arange_pos(1, 6))
    assert np.abs(np.asarray(logits) - expected).max() < 1e-4


# --------------------------------------------------------------------------------------------------
# configs we do not read: refused before any tensor is read
def edit_config(path, **changes):
    cfg = json.load(open(f"{path}/config.json"))
    cfg.update(changes)
    json.dump({k: v for k, v in cfg.items() if v is not None}, open(f"{path}/config.json", "w"))


@pytest.mark.parametrize(
    "break_it, match",
    [
        (lambda p: edit_config(p, model_type="qwen3_moe"), r"config\.json: .*model_type"),
        (lambda p: edit_config(p, num_experts=8), r"config\.json: .*num_experts"),
        (lambda p: edit_config(p, head_dim=None), r"config\.json: .*head_dim is missing"),
        (
            lambda p: edit_config(p, tie_word_embeddings=False),
            r"model\.safetensors: tensor lm_head\.weight is missing",
        ),
        (
            lambda p: edit_config(p, intermediate_size=48),
            r"model\.safetensors: model\.layers\.0\.mlp\.gate_proj\.weight is \(64, 32\), "
            r"config\.json implies",
        ),
    ],
)
def test_broken_checkpoints_fail_clearly(tmp_path, monkeypatch, break_it, match):
    path = write_tiny_checkpoint(str(tmp_path))
    break_it(path)
    monkeypatch.setattr(
        np, "memmap", lambda *a, **k: pytest.fail("read a tensor before the checks")
    )
    with pytest.raises(ValueError, match=match):
        hf_checkpoint.load(path)


def test_sharded_missing_tensor_names_the_index(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path), shards=2)
    edit_config(path, tie_word_embeddings=False)
    with pytest.raises(
        ValueError, match=r"safetensors\.index\.json: tensor lm_head\.weight is missing"
    ):
        hf_checkpoint.load(path)


def test_repo_id_without_huggingface_hub_says_what_to_do(monkeypatch):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        hf_checkpoint.load("no-such-directory")
    # as if not installed; nothing is downloaded
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(FileNotFoundError, match="pip install huggingface_hub"):
        hf_checkpoint.load("Qwen/Qwen3-0.6B")


# ---- broken files, one-line messages, untouched folders
def one_line(e):  # the message stands alone: one line, no chained traceback from inside a library
    assert "\n" not in str(e.value) and (e.value.__cause__ is None)
    assert e.value.__suppress_context__ or e.value.__context__ is None


def no_tensor_reads(monkeypatch):
    monkeypatch.setattr(
        np, "memmap", lambda *a, **k: pytest.fail("read a tensor before the checks")
    )


def rewrite_header(file, change):
    # change(header dict) in place; the tensors' bytes are kept as they are
    raw = open(file, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    open(file, "wb").write(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def poke(file, data):  # overwrite the first bytes of a file
    with open(file, "r+b") as f:
        f.write(data)


def cut(file, keep):  # truncate a file to its first `keep` bytes (keep < 0: drop the last -keep)
    raw = open(file, "rb").read()
    open(file, "wb").write(raw[:keep])


def set_entry(name, **kv):
    return lambda h: h[name].update(kv)


def files_of(path):  # {file name: bytes}: to check that nothing was touched
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


# --------------------------------------------------------------------------------------------------
# checkpoints that are broken on disk
ST = "model.safetensors"


NORM = "model.norm.weight"  # (32,) BF16: 64 bytes


LAST = "model.layers.1.mlp.down_proj.weight"  # the last tensor in the file


@pytest.mark.parametrize(
    "break_it, match",
    [
        (
            lambda f: cut(f, -100),
            rf"{ST}: {LAST} ends at byte (\d+), the file has \d+: it is truncated",
        ),
        (lambda f: cut(f, 5), rf"{ST}: truncated, or its \d+-byte header is not safetensors JSON"),
        (
            lambda f: cut(f, 200),
            rf"{ST}: truncated, or its \d+-byte header is not safetensors JSON",
        ),
        (
            lambda f: poke(f, (10**12).to_bytes(8, "little")),
            rf"{ST}: truncated, or its 1000000000000-byte header is not safetensors JSON",
        ),
        (lambda f: poke(f, b"\0" * 8 + b'{"x'), rf"{ST}: truncated, or its 0-byte header is not"),
        (lambda f: None, None),  # the control: an intact file
        (
            lambda f: rewrite_header(f, lambda h: h.__setitem__(NORM, [1, 2])),
            rf"{ST}: truncated, or its",
        ),
        (
            lambda f: rewrite_header(f, lambda h: h[NORM].pop("data_offsets")),
            rf"{ST}: truncated, or its",
        ),
        (
            lambda f: rewrite_header(f, set_entry(NORM, data_offsets=[0, 64, 128])),
            rf"{ST}: truncated, or its",
        ),
        (
            lambda f: rewrite_header(f, set_entry(NORM, dtype="F64")),
            rf"{ST}: {NORM} has dtype F64, not one of BF16, F16, F32",
        ),
        (lambda f: rewrite_header(f, set_entry(NORM, dtype="I8")), rf"{ST}: {NORM} has dtype I8"),
        (
            lambda f: rewrite_header(f, set_entry(NORM, data_offsets=[0, 10])),
            rf"{ST}: {NORM} has data_offsets for 10 bytes, \(32,\) in BF16 takes 64",
        ),
        (
            lambda f: rewrite_header(
                f, set_entry(NORM, dtype="F32")
            ),  # F32 needs 128 bytes, the offsets hold 64
            rf"{ST}: {NORM} has data_offsets for 64 bytes, \(32,\) in F32 takes 128",
        ),
        (
            lambda f: rewrite_header(f, set_entry(NORM, data_offsets=[10**9, 10**9 + 64])),
            rf"{ST}: {NORM} ends at byte \d+, the file has \d+: it is truncated",
        ),
    ],
)
def test_broken_safetensors_fail_before_any_tensor_is_read(tmp_path, monkeypatch, break_it, match):
    path = write_tiny_checkpoint(str(tmp_path))
    break_it(f"{path}/{ST}")
    no_tensor_reads(monkeypatch)
    if match is None:  # the control: an intact file passes the checks and reaches the reads
        with pytest.raises(pytest.fail.Exception, match="read a tensor"):
            hf_checkpoint.load(path)
        return
    with pytest.raises(ValueError, match=match) as e:
        hf_checkpoint.load(path)
    one_line(e)
    assert str(e.value).startswith(f"{path}/{ST}: ")  # the full path of the file


def test_truncation_names_the_byte_the_file_lacks(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path))
    size = os.path.getsize(f"{path}/{ST}")
    cut(f"{path}/{ST}", -1)  # one byte short: the last tensor ends at `size`
    with pytest.raises(
        ValueError,
        match=rf"{LAST} ends at byte {size}, the file has {size - 1}: it is "
        "truncated",
    ):
        hf_checkpoint.load(path)


def test_broken_shard_names_the_shard(tmp_path, monkeypatch):
    path = write_tiny_checkpoint(str(tmp_path), shards=2)
    shard = "model-00002-of-00002.safetensors"
    cut(f"{path}/{shard}", -1)
    no_tensor_reads(monkeypatch)
    with pytest.raises(ValueError, match=rf"{shard}: model\.layers\.\d\.[a-z_.]+ ends at byte"):
        hf_checkpoint.load(path)
    os.remove(f"{path}/{shard}")
    with pytest.raises(FileNotFoundError, match=shard):
        hf_checkpoint.load(path)


@pytest.mark.parametrize(
    "text", ['{"model_type": "qwen3", "hidden_size": 3', "", "\xff\xfe not json"]
)
def test_invalid_config_json_names_the_file(tmp_path, monkeypatch, text):
    path = write_tiny_checkpoint(str(tmp_path))
    open(f"{path}/config.json", "wb").write(text.encode("latin-1"))
    no_tensor_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON \(") as e:
        hf_checkpoint.load(path)
    assert type(e.value) is ValueError  # not json's JSONDecodeError
    one_line(e)


def test_invalid_index_and_tokenizer_json_name_the_file(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path / "a"), shards=2)
    cut(f"{path}/model.safetensors.index.json", 30)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        hf_checkpoint.load(path)
    path = write_tiny_checkpoint(str(tmp_path / "b"))
    cut(f"{path}/vocab.json", 30)
    with pytest.raises(ValueError, match=r"vocab\.json: not valid JSON"):
        hf_checkpoint.load(path)


def test_stale_index_beside_a_single_file_is_refused(tmp_path, monkeypatch):
    path = write_tiny_checkpoint(str(tmp_path / "sharded"), shards=2)
    shutil.copy(write_tiny_checkpoint(str(tmp_path / "single"), seed=1) + f"/{ST}", path)
    no_tensor_reads(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"sharded holds both model\.safetensors and .*sharded/model\."
        r"safetensors\.index\.json: remove the stale one",
    ) as e:
        hf_checkpoint.load(path)
    one_line(e)


def test_missing_eos_says_what_to_add(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path))
    os.remove(f"{path}/generation_config.json")
    assert hf_checkpoint.load(path).tokenizer.eos_ids == (277,)  # config.json's <|im_end|>
    edit_config(path, eos_token_id=None)
    # tokenizer_config.json's eos_token <|im_end|>
    assert hf_checkpoint.load(path).tokenizer.eos_ids == (277,)
    tc = json.load(open(f"{path}/tokenizer_config.json"))
    json.dump(dict(tc, eos_token=None), open(f"{path}/tokenizer_config.json", "w"))
    with pytest.raises(
        ValueError,
        match=rf"^{path}: no eos_token_id in generation_config\.json or "
        r"config\.json: add one$",
    ) as e:
        hf_checkpoint.load(path)
    one_line(e)


# --------------------------------------------------------------------------------------------------
# paths and repo ids: only owner/name goes to the hub
def fake_hub(monkeypatch, snapshot=None):
    """A huggingface_hub module whose snapshot_download(repo, allow_patterns) is
    snapshot(repo, patterns); unset, it fails the test (nothing may be fetched)."""

    def never(*a):
        pytest.fail(f"the hub was asked for {a}")

    def snapshot_download(repo, allow_patterns):
        return (snapshot or never)(repo, allow_patterns)

    hub = types.ModuleType("huggingface_hub")
    hub.__spec__ = importlib.machinery.ModuleSpec("huggingface_hub", None)
    hub.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)


def hub_serving(remote, cache, asked):
    # a snapshot_download that copies the files it is asked for into cache
    def snapshot(repo, patterns):
        asked.append((repo, patterns))
        os.makedirs(cache, exist_ok=True)
        for f in os.listdir(remote):
            if any(fnmatch.fnmatch(f, p) for p in patterns):
                shutil.copy(f"{remote}/{f}", cache)
        return cache

    return snapshot


@pytest.mark.parametrize(
    "path",
    [
        "/no/such/dir",
        "./no/such",
        "no-such-dir",
        "~/no-such",
        ".",
        "..x/y",
        "a/b/c",
        "a\\b",
        "owner/",
        "/owner",
        "/owner/name",
        "C:\\ckpt",
    ],
)
def test_missing_local_paths_are_not_repo_ids(tmp_path, monkeypatch, path):
    fake_hub(monkeypatch)
    if path == ".":
        monkeypatch.chdir(tmp_path)  # an existing directory without config.json
        with pytest.raises(FileNotFoundError, match="config.json"):
            hf_checkpoint.load(path)
        return
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(path)} is not a directory") as e:
        hf_checkpoint.load(path)
    one_line(e)


def test_an_existing_file_is_not_a_repo_id(tmp_path, monkeypatch):
    fake_hub(monkeypatch)
    path = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"^ckpt/{ST} is not a directory"):
        hf_checkpoint.load(f"ckpt/{ST}")  # looks like owner/name, but it is a file
    with pytest.raises(FileNotFoundError, match=f"{path}/{ST} is not a directory"):
        hf_checkpoint.load(f"{path}/{ST}")


def test_repo_id_downloads_config_first_then_the_checkpoint(tmp_path, monkeypatch):
    remote, cache, asked = (
        write_tiny_checkpoint(str(tmp_path / "remote")),
        str(tmp_path / "cache"),
        [],
    )
    fake_hub(monkeypatch, hub_serving(remote, cache, asked))
    m, ref = hf_checkpoint.load("owner/name"), hf_checkpoint.load(remote)
    assert asked == [
        ("owner/name", ["config.json"]),
        ("owner/name", ["*.json", "*.safetensors", "merges.txt"]),
    ]
    assert m.path == cache and m.cfg == ref.cfg and m.tokenizer.eos_ids == (277, 275)
    assert all(
        bool((a == b).all())
        for a, b in zip(jax.tree.leaves(m.weights), jax.tree.leaves(ref.weights), strict=True)
    )
    shutil.rmtree(cache)
    asked.clear()
    # an unsupported model: nothing but its config is downloaded
    edit_config(remote, model_type="qwen3_moe")
    with pytest.raises(ValueError, match=r"^owner/name/config\.json: model_type"):
        hf_checkpoint.load("owner/name")
    assert asked == [("owner/name", ["config.json"])] and os.listdir(cache) == ["config.json"]


@pytest.mark.parametrize("fail_at", ["config", "snapshot"])
@pytest.mark.parametrize(
    "error",
    [
        ConnectionError(
            "Failed to resolve 'huggingface.co' ([Errno -2] Name or service not known)"
        ),
        OSError(
            "An error happened while trying to locate the file on the Hub and we cannot find the "
            "requested files in the local cache.\nPlease check your connection and try again.\n"
            + "x"
            * 500
        ),
        RuntimeError(""),  # any type the hub raises, even with no message
    ],
)
def test_unreachable_hub_says_what_to_do(tmp_path, monkeypatch, fail_at, error):
    path = write_tiny_checkpoint(str(tmp_path))

    def snapshot(repo, patterns):  # reaches the hub for config.json, then not, or never
        if fail_at == "config" or patterns != ["config.json"]:
            raise error
        return path

    fake_hub(monkeypatch, snapshot)
    with pytest.raises(
        ValueError,
        match=rf"^Qwen/Qwen3-0\.6B could not be downloaded from the Hugging "
        rf"Face hub \({type(error).__name__}\(.*\): pass a local checkpoint "
        r"directory with --model$",
    ) as e:
        hf_checkpoint.load("Qwen/Qwen3-0.6B")
    one_line(e)
    assert len(str(e.value)) < 300


# --------------------------------------------------------------------------------------------------
# saving: only into a folder that holds no checkpoint but save()'s own; a crash leaves the old files
# whole
def same_weights(a, b):
    return all(
        bool((x == y).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("shards", [1, 2])
def test_save_refuses_a_foreign_checkpoint_and_leaves_it_untouched(tmp_path, shards):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src"), seed=1))
    theirs = write_tiny_checkpoint(str(tmp_path / "theirs"), shards=shards)
    before = files_of(theirs)
    held = (
        "config.json, model-00001-of-00002.safetensors, model-00002-of-00002.safetensors, "
        "model.safetensors.index.json"
        if shards == 2
        else "config.json, model.safetensors"
    )
    for call in (
        lambda: hf_checkpoint.check_save_dir(theirs),
        lambda: hf_checkpoint.save(theirs, m.cfg, m.weights),
    ):
        with pytest.raises(
            ValueError,
            match=rf"theirs holds a checkpoint that save\(\) did not write: "
            rf"{held}$",
        ):
            call()
    assert files_of(theirs) == before


@pytest.mark.parametrize(
    "held, ours",
    [
        ("model.safetensors.index.json", True),
        ("x.safetensors", True),
        ("model.safetensors.tmp.safetensors", True),
        ("config.json", False),
    ],
)
def test_save_refuses_any_checkpoint_file(tmp_path, held, ours):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src")))
    out = tmp_path / "out"
    if ours:  # save()'s own folder, then a foreign file joins it
        hf_checkpoint.save(str(out), m.cfg, m.weights)
    out.mkdir(exist_ok=True)
    open(out / held, "w").write("{}")
    with pytest.raises(
        ValueError, match=rf"out holds a checkpoint that save\(\) did not write: .*{held}"
    ):
        hf_checkpoint.check_save_dir(str(out))


def test_save_refuses_a_safetensors_it_did_not_mark(tmp_path):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src")))
    out = str(tmp_path / "out")
    hf_checkpoint.save(out, m.cfg, m.weights)
    rewrite_header(f"{out}/{ST}", lambda h: h.__setitem__("__metadata__", {"format": "pt"}))
    with pytest.raises(ValueError, match="did not write: config.json, model.safetensors"):
        hf_checkpoint.check_save_dir(out)


def test_resave_into_its_own_output_loads_the_new_weights(tmp_path):
    old = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "a"), seed=1, shards=2))
    new = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "b"), seed=2))
    assert not same_weights(old.weights, new.weights)
    out = str(tmp_path / "out" / "deeper")  # folders that do not exist yet
    hf_checkpoint.check_save_dir(out)
    assert not os.path.exists(tmp_path / "out")  # the check creates nothing
    hf_checkpoint.save(out, old.cfg, old.weights, old.path)  # with a's tokenizer, not its index
    hf_checkpoint.save(out, new.cfg, new.weights)  # the tokenizer files stay
    back = hf_checkpoint.load(out)
    assert same_weights(back.weights, new.weights) and back.tokenizer.eos_ids == (277, 275)
    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "merges.txt",
        ST,
        "tokenizer_config.json",
        "vocab.json",
    ]  # no temporary file left
    raw = open(f"{out}/{ST}", "rb").read()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["__metadata__"] == {"format": "pt", "saved_by": "score-centering"}


def test_save_refuses_a_file_or_a_folder_it_cannot_write(tmp_path):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src")))
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for out in (file, file / "sub"):
        with pytest.raises(ValueError, match=f"{out}: {file} is not a writable directory$"):
            hf_checkpoint.save(str(out), m.cfg, m.weights)
    assert file.read_text() == "mine"
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: the permission check cannot fail here")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    with pytest.raises(ValueError, match=f"{locked}/x: {locked} is not a writable directory$"):
        hf_checkpoint.check_save_dir(str(locked / "x"))


class Crash(Exception):
    pass


@pytest.mark.parametrize("crash", ["while writing", "before the rename", "between the renames"])
def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch, crash):
    old = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "a"), seed=1))
    new = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "b"), seed=2))
    out = str(tmp_path / "out")
    hf_checkpoint.save(out, old.cfg, old.weights)
    before = files_of(out)
    real_write, real_replace, renames = hf_checkpoint.Path.write_bytes, os.replace, []

    def write_half(self, data):  # the disk fills up halfway through the file
        real_write(self, data[: len(data) // 2])
        raise Crash

    def replace(src, dst):
        renames.append(os.path.basename(dst))
        if crash == "before the rename" or len(renames) == 2:
            raise Crash
        real_replace(src, dst)

    if crash == "while writing":
        monkeypatch.setattr(hf_checkpoint.Path, "write_bytes", write_half)
    else:
        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        hf_checkpoint.save(out, new.cfg, new.weights)
    monkeypatch.undo()
    after = {f: b for f, b in files_of(out).items() if f != "save.partial"}
    if crash == "between the renames":  # the weights are new and whole, the config.json the same
        assert after.keys() == before.keys() and after["config.json"] == before["config.json"]
        assert same_weights(hf_checkpoint.load(out).weights, new.weights)
    else:
        assert after == before and same_weights(hf_checkpoint.load(out).weights, old.weights)
    hf_checkpoint.save(out, new.cfg, new.weights)  # the leftover temporary file blocks nothing
    assert same_weights(
        hf_checkpoint.load(out).weights, new.weights
    ) and "save.partial" not in os.listdir(out)


def test_a_crash_during_a_first_save_leaves_a_folder_save_accepts(tmp_path, monkeypatch):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "a")))
    out, real_replace = str(tmp_path / "out"), os.replace

    def replace(src, dst):  # model.safetensors lands, then the process dies before config.json does
        if os.path.basename(dst) != ST:
            raise Crash
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        hf_checkpoint.save(out, m.cfg, m.weights)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == [ST, "save.partial"]
    hf_checkpoint.check_save_dir(out)  # model.safetensors alone still marks the folder as save()'s
    hf_checkpoint.save(out, m.cfg, m.weights)
    assert same_weights(hf_checkpoint.load(out).weights, m.weights)
