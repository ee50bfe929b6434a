"""harness.py's flags: defaults and recipes, bad flags, paths and data refused at once in one line
before anything is written, and flags checked against the checkpoint's config.json with the
network down."""

import importlib.util
import json
import math
import os
import urllib.error

import jax
import pytest

import score_centering as sc
import train
from helpers import tiny_argv, write_gsm8k, write_tiny_checkpoint
from lab import harness, hf_checkpoint, problems, tasks


def test_relative_paths_to_new_folders_are_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = harness.parse_args(["--task", "sequence", "--out", "runs/a", "--save", "ckpt/b"])
    assert (args.out, args.save) == ("runs/a", "ckpt/b") and not os.path.exists("runs")


def test_resume_accepts_its_own_folder_as_out_however_spelled(tmp_path, monkeypatch):
    """--out naming the --resume folder is the same folder with a trailing slash, a ./ or an
    absolute path: accepted, and the run goes on in that folder."""
    monkeypatch.chdir(tmp_path)
    harness.start(harness.parse_args("--task sequence --steps 3 --out runs/a".split()))
    harness.log_step({"step": 0}, 3, "runs/a")  # its first row: then run.json
    assert os.path.isfile("runs/a/run.json")
    for out in ("runs/a", "runs/a/", "./runs/a", str(tmp_path / "runs" / "a") + "/"):
        args = harness.parse_args(["--resume", "runs/a", "--out", out])
        assert os.path.abspath(args.out) == str(tmp_path / "runs" / "a") and args.steps == 3, out


def test_several_processes_run_a_compare_one_run_at_a_time(monkeypatch):
    """Threads of several processes could enter different runs' collectives: one run at a time."""
    assert harness.parse_args("--task sequence --compare --workers 2".split()).workers == 2
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert harness.parse_args("--task sequence --compare --workers 2".split()).workers == 1


def test_a_sequence_sweep_defaults_to_eight_seeds_and_exact_centring_unless_told():
    sweep = harness.parse_args("--task sequence --sweep".split())
    assert (sweep.seeds, sweep.steps, sweep.eval_every, sweep.topk) == (tuple(range(8)), 150, 25, 0)
    given = "--task sequence --sweep int8 --seeds 3 --steps 40 --eval-every 5 --topk 128".split()
    told = harness.parse_args(given)
    assert (told.seeds, told.steps, told.eval_every, told.topk) == ((3,), 40, 5, 128)
    compare = harness.parse_args("--task sequence --compare".split())  # not a sweep: its recipe
    assert (compare.seeds, compare.steps, compare.topk) == (None, 150, 128)
    assert harness.parse_args("--sweep 0".split()).seeds is None  # GSM8K: no sweep recipe


def test_micro_batch_default_fits_small_batches_and_help_shows_defaults(capsys):
    assert harness.parse_args(["--prompts", "2", "--group", "2"]).micro_batch == 4
    assert harness.parse_args(["--prompts", "32", "--group", "8"]).micro_batch == 16
    # at most 8,192 completion tokens a pass: 64 rows of 128; all 32 of the sequence task's 16
    assert harness.parse_args(["--max-tokens", "128", "--prompts", "32"]).micro_batch == 64
    assert harness.parse_args(["--task", "sequence"]).micro_batch == 32
    with pytest.raises(SystemExit):
        harness.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "--seed SEED seed",
        "(default: 0)",
        "--eval-every EVAL_EVERY evaluate every N steps (default: gsm8k 10",
        "--task {gsm8k,arithmetic,sequence,chain,chain-hybrid} gsm8k, arithmetic;",
        "(default: Qwen/Qwen3-0.6B)",
    ):
        assert needle in text, needle


def test_correction_is_kept_as_typed_and_makes_that_constructors_correction():
    """--correction NAME:ARGS stays the text typed (run.json and --resume compare it so), and
    harness.correction calls score_centering's constructor of that name with the numbers."""
    for text, made in (
        ("tis:2", sc.tis(2.0)),
        ("tis:inf", sc.tis(math.inf)),  # untruncated IS
        ("mis:0.5,5", sc.mis(0.5, 5.0)),
        ("ppo:0.2,0.28", sc.ppo(0.2, 0.28)),  # DAPO
        ("ppo:0.2,0.28,3", sc.ppo(0.2, 0.28, 3.0)),  # a dual clip
        ("cispo:0.2,0.28", sc.cispo(0.2, 0.28)),
        ("gspo:3e-4,4e-4", sc.gspo(3e-4, 4e-4)),
        ("topr", sc.topr()),
    ):
        assert harness.parse_args(["--correction", text]).correction == text
        assert harness.correction(text) == made, text
    assert harness.parse_args([]).correction is None and harness.correction(None) is None


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--topk", "-1"], "--topk"),
        (["--lr", "nan"], "--lr"),
        (["--weight-noise", "inf"], "--weight-noise"),
        (["--correction", "dppo:0.2"], "--correction dppo:0.2: dppo masks by the shift"),
        (["--correction", "nope:1"], "--correction nope:1: unknown: use tis:C, mis:LO,HI, ppo:"),
        (["--correction", "tis"], "--correction tis: tis() missing"),
        (["--correction", "tis:0"], "--correction tis:0: correction must be"),
        (["--correction", "tis:nan"], "--correction tis:nan: correction must be"),
        (["--correction", "mis:5,0.5"], "--correction mis:5,0.5: correction must be"),
        (["--correction", "ppo:0.2"], "--correction ppo:0.2: ppo() missing"),
        (["--correction", "ppo:a,b"], "--correction ppo:a,b: could not convert"),
        (["--correction", "cispo:0.2,-2"], "--correction cispo:0.2,-2: correction must be"),
        (["--correction", "topr:1"], "--correction topr:1: topr() takes 0"),
        (["--group", "1"], "--group"),
        (["--micro-batch", "7"], "--micro-batch"),
        (["--task", "sequence", "--data-dir", "x"], "--data-dir is not used by --task sequence"),
        (["--task", "sequence", "--model", "x"], "--model is not used by --task sequence"),
        (
            ["--task", "arithmetic", "--data-dir", "x"],
            "--data-dir is not used by --task arithmetic",
        ),
        (["--workers", "2"], "--seeds and --workers are for --compare"),
        (["--seeds", "0,1"], "--seeds"),
        (["--plot", "x.png"], "--plot"),
        (["--lora-alpha", "4"], "--lora-alpha"),
        (["--plan", "--save", "x"], "--plan only prints"),
        (["--plan", "--compare"], "--plan only prints"),
        (["--plan", "--out", "runs/x"], "--plan only prints"),
        (["--lora", "4", "--lora-alpha", "0"], "--lora-alpha"),
        (["--data-dir", "/nonexistent"], "--data-dir"),
        (["--steps", "0"], "--steps"),
        (["--eval-every", "0"], "--eval-every"),
        (["--task", "sequence", "--eval-every", "-5"], "--eval-every"),
        (["--sweep", "--weight-noise", "0.1"], "--weight-noise"),
        (["--sweep", "0,int8", "--weight-noise", "0"], "--weight-noise"),
        (["--task", "sequence", "--sweep", "--kv-quant", "int8"], "--kv-quant"),
        (["--sweep", "--sampler", "fp8"], "--sampler"),
        (["--resume", "/nonexistent"], "--resume"),
        (["--prompts", "0"], "--prompts"),
        (["--micro-batch", "0"], "--micro-batch"),
        (["--save-every", "0"], "--save-every"),
        (["--lora", "0"], "--lora"),
        (["--out", ""], "--out"),
        (["--compare", "--seeds", "0,0"], "--seeds"),
        (["--seed", "-1"], "--seed"),
        (["--compare", "--center"], "--center"),
    ],
)
def test_bad_flags_fail_at_once(argv, match, capsys):
    with pytest.raises(SystemExit):
        harness.parse_args(argv)
    err = capsys.readouterr().err.split("error:")[1]
    assert match in err and err.count("\n") == 1  # one line, the message, not the usage


def _error(argv, capsys):
    # the one line a bad run prints (parse errors on stderr, load errors as SystemExit)
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    text = (
        capsys.readouterr().err.split("error:")[-1] if e.value.code == 2 else str(e.value)
    ).strip()
    assert "\n" not in text and "Traceback" not in text
    return text


def test_bad_paths_fail_before_anything_is_written(tmp_path, gsm, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("")
    foreign = write_tiny_checkpoint(str(tmp_path / "foreign"), shards=2)
    before = sorted(os.listdir(foreign))
    assert "writable folder" in _error(tiny_argv(gsm, "--out", str(tmp_path / "file")), capsys)
    assert "not empty" in _error(tiny_argv(gsm, "--out", str(tmp_path / "used")), capsys)
    assert "--model" in _error(tiny_argv(gsm, "--save", gsm[0]), capsys)
    os.symlink(gsm[0], tmp_path / "link")
    assert "--model" in _error(tiny_argv(gsm, "--save", str(tmp_path / "link")), capsys)
    assert "--save" in _error(tiny_argv(gsm, "--save", foreign), capsys)
    assert sorted(os.listdir(foreign)) == before
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "matplotlib" in _error(
        tiny_argv(gsm, "--compare", "--plot", str(tmp_path / "p.png")), capsys
    )
    run = tmp_path / "run"  # a run to resume, and an --out elsewhere: refused, not dropped
    run.mkdir()
    (run / "run.json").write_text("{}")
    msg = _error(tiny_argv(gsm, "--resume", str(run), "--out", str(tmp_path / "other")), capsys)
    assert "--resume DIR continues the run in DIR" in msg


def test_a_batch_the_micro_batches_or_devices_cannot_split_is_refused_in_one_line(
    tmp_path, gsm, capsys, monkeypatch
):
    """B = P·G rows go through the train step --micro-batch rows at a time, each split evenly over
    the devices: a micro-batch that does not divide B, or is not a multiple of the devices, is
    refused in one line; a B the devices cannot share (then no size fits, the default neither)
    is named as such, not as a --micro-batch nobody typed. Both before anything is loaded or
    compiled: in a run, a --compare, a --sweep, --plan and a --resume; a --resume on other
    devices may pick a size that fits them."""

    def never(*a, **kw):
        raise AssertionError("loaded, though the batch cannot be split")

    monkeypatch.setattr(tasks, "load", never)
    assert jax.device_count() == 4  # conftest.py's CPU devices
    seq = ["--task", "sequence"]  # B = 4 prompts x 8 = 32 rows: 4, 8, 16 or 32 a pass fit
    for argv in (
        [*seq, "--micro-batch", "5"],
        [*seq, "--micro-batch", "2"],  # divides 32, but half a row a device
        [*seq, "--micro-batch", "64"],
        [*seq, "--compare", "--micro-batch", "12"],
        [*seq, "--sweep", "0,int8", "--micro-batch", "12"],
        [*seq, "--plan", "--micro-batch", "12"],
        tiny_argv(gsm, "--prompts", "4", "--group", "8", "--micro-batch", "12"),
    ):
        msg = _error(argv, capsys)
        assert "--micro-batch" in msg and "= 32 and be a multiple of the 4 devices" in msg, msg
    for argv in (
        [*seq, "--prompts", "3", "--group", "2"],
        [*seq, "--sweep", "--prompts", "5", "--group", "2"],
    ):
        msg = _error(argv, capsys)  # the default micro-batch: no size fits
        assert "must be a multiple of the 4 devices" in msg and "--micro-batch" not in msg, msg

    # a run started where 2 rows a pass fit (one or two devices), resumed on 4
    run = tmp_path / "run"
    run.mkdir()
    config = harness.run_config(harness.parse_args(seq)) | dict(micro_batch=2)
    (run / "run.json").write_text(json.dumps(config))
    msg = _error(["--resume", str(run)], capsys)
    assert "--micro-batch 2 must divide" in msg, msg
    assert harness.parse_args(["--resume", str(run), "--micro-batch", "8"]).micro_batch == 8


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "holds no problems"),
        (b'{"question": "q", "answer": "#### 4"}\n\xff\xfe\n', "train.jsonl:2"),
        (b'{"question": "q", "answer": "#### seventy"}\n', "train.jsonl:1"),
    ],
)
def test_bad_data_is_named_with_file_and_line(tmp_path, gsm, capsys, content, match):
    data = write_gsm8k(tmp_path / "d")
    (tmp_path / "d" / "train.jsonl").write_bytes(content)
    msg = _error(tiny_argv(gsm, "--data-dir", data), capsys)
    assert match in msg and "error: " in msg


def test_flags_checked_against_the_checkpoint_and_offline_data(tmp_path, gsm, capsys, monkeypatch):
    assert "--topk 400" in _error(tiny_argv(gsm, "--topk", "400"), capsys)
    assert "--topk 10000 exceeds" in _error(["--task", "sequence", "--topk", "10000"], capsys)
    msg = _error(tiny_argv(gsm, "--max-tokens", "600"), capsys)
    assert "--max-tokens 600 reaches past the 512 positions" in msg
    assert "/no/such/dir" in _error(tiny_argv(gsm, "--model", "/no/such/dir"), capsys)

    def offline(*a, **kw):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(problems.urllib.request, "urlretrieve", offline)
    monkeypatch.setenv("HOME", str(tmp_path))
    msg = _error(["--model", gsm[0], "--max-tokens", "8"], capsys)
    assert "GSM8K could not be downloaded" in msg and "--data-dir" in msg
    assert not os.path.exists(tmp_path / ".cache" / "score-centering")  # no empty cache folder left
    # what config.json decides is refused before GSM8K or a weight is fetched (the network is down)
    monkeypatch.setattr(hf_checkpoint, "load", None)
    big = tmp_path / "big"  # a config.json alone, of Qwen3's vocabulary
    big.mkdir()
    cfg = json.load(open(os.path.join(gsm[0], "config.json"))) | dict(vocab_size=151936)
    json.dump(cfg, open(big / "config.json", "w"))
    for flags, says in (
        ("--topk 0 --max-tokens 8", "--topk 0 records q over all 151936"),
        ("--topk 200000 --max-tokens 8", "--topk 200000 exceeds"),
        ("--max-tokens 512", "past the 512 positions"),
    ):
        assert says in _error(["--model", str(big), *flags.split()], capsys)
