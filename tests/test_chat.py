"""HuggingFace tokenizer directories: the checkpoint's ids, specials and chat template, with
transformers itself as the oracle (`AutoTokenizer.apply_chat_template` on the same directory).

Nothing is downloaded: each test builds a tiny byte-level BPE tokenizer in tmp_path with the
pipeline of the family it stands for (Qwen2's and Llama 3's pre-tokenizer regexes) and writes a
tokenizer_config.json around the family's real chat template. The templates are verbatim from
huggingface/huggingface.js (tests/chat_templates.json says where exactly).
"""

import json
import pickle
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.preprocess import Limits, Params, Preprocessor, Sizes
from jaxmllm.data.records.record import parse_record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.text.tokenizer import HFTokenizer, PretrainedTokenizer, make_tokenizer

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

TEMPLATES = json.loads((Path(__file__).parent / "chat_templates.json").read_text())
QWEN_RE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA_RE = QWEN_RE.replace(r"\p{N}|", r"\p{N}{1,3}|")
CORPUS = [
    "Hello, how are you? I'm fine, thank you. What is in this picture?",
    "The quick brown fox jumps over the lazy dog; a red circle on a mat.",
    "You are a helpful assistant. Today is a good day to count: 12 345 6789!",
]
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello, how are you?"},
    {"role": "assistant", "content": "I'm fine, thank you."},
    {"role": "user", "content": "What is in this picture?"},
    {"role": "assistant", "content": "A red circle on a mat.\n"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "count",
            "description": "Counts the <things> & 'stuff' in a picture",
            "parameters": {"type": "object", "properties": {"what": {"type": "string"}}},
        },
    }
]


def build_dir(path: Path, family: str, template: str | None, extra=(), **config) -> Path:
    """A tokenizer directory as HF writes one: tokenizer.json (a byte-level BPE trained on a
    few sentences, with the family's pre-tokenizer, `extra` special tokens added) and
    tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, processors, trainers
    from tokenizers import normalizers as norm
    from tokenizers import pre_tokenizers as pre

    qwen = family != "llama"
    specials = (QWEN_SPECIALS if qwen else LLAMA_SPECIALS) + list(extra)
    tk = Tokenizer(models.BPE())
    tk.normalizer = norm.NFC()
    split = pre.Split(Regex(QWEN_RE if qwen else LLAMA_RE), behavior="isolated", invert=False)
    tk.pre_tokenizer = pre.Sequence([split, pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre.ByteLevel.alphabet(), show_progress=False
    )
    tk.train_from_iterator(CORPUS * 4, trainer)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    byte_level = processors.ByteLevel(trim_offsets=False)
    if qwen:
        tk.post_processor = byte_level
        named = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        named.update(tokenizer_class="Qwen2Tokenizer", unk_token=None)
    else:  # Llama 3's tokenizer.json prepends <|begin_of_text|>
        bos = "<|begin_of_text|>"
        ids = [(bos, tk.token_to_id(bos))]
        prepend = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=ids
        )
        tk.post_processor = processors.Sequence([byte_level, prepend])
        named = {"bos_token": bos, "eos_token": "<|eot_id|>"}
        named.update(tokenizer_class="PreTrainedTokenizerFast")
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    added = {
        str(tk.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in specials
    }
    body = {"added_tokens_decoder": added, **named, "model_max_length": 131072, **config}
    if template is not None:
        body["chat_template"] = TEMPLATES[template]
    (path / "tokenizer_config.json").write_text(json.dumps(body, indent=1))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "qwen": build_dir(root / "qwen", "qwen", "Qwen/Qwen2.5-7B-Instruct"),
        "llama": build_dir(root / "llama", "llama", "meta-llama/Llama-3.1-8B-Instruct"),
        "qwen-vl": build_dir(root / "vl", "qwen", "Qwen/Qwen2.5-VL-7B-Instruct"),
    }


def hf(directory: Path):
    from transformers import AutoTokenizer  # the oracle; imported only where needed

    return AutoTokenizer.from_pretrained(str(directory))


def hf_ids(directory: Path, messages, **kwargs) -> list[int]:
    out = hf(directory).apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"])  # transformers 5 returns a BatchEncoding by default


def chat_record(messages, **media) -> object:
    return parse_record({"id": "rec-1", "messages": messages, **media}, Path("."), 1)


def flat(pieces, specials) -> tuple[np.ndarray, np.ndarray]:
    """Ids and loss of pieces, each media marker as one placeholder (what HF's template has)."""
    ids, loss = [], []
    for p in pieces:
        if p[0] == "text":
            ids += p[1].tolist()
            loss += p[2].tolist()
        else:
            ids.append(specials.media[p[0]])  # (a media marker: its phase, its item)
            loss.append(False)
    return np.asarray(ids), np.asarray(loss)


@pytest.mark.parametrize("family", ["qwen", "llama"])
@pytest.mark.parametrize("system", [True, False])
def test_chat_ids_and_loss_match_hf(dirs, family, system):
    messages = CHAT if system else CHAT[1:]  # Qwen2.5 writes its default system prompt
    tk = make_tokenizer(str(dirs[family]))
    ids, loss = flat(tk.pieces(chat_record(messages)), tk.specials)
    assert ids.tolist() == hf_ids(dirs[family], messages)
    # Independently: each assistant turn's tokens are its content's and the end-of-turn token,
    # starting right where HF's generation prompt before that turn ends; nothing else learned.
    want = np.zeros(len(ids), bool)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(hf_ids(dirs[family], messages[:i], add_generation_prompt=True))
            content = m["content"].strip() if family == "llama" else m["content"]  # | trim
            turn = tk.encode(content).tolist() + [tk.specials.eos]
            assert ids[start : start + len(turn)].tolist() == turn
            want[start : start + len(turn)] = True
    np.testing.assert_array_equal(loss, want)
    assert tk.decode(ids[loss]).count(tk.decode([tk.specials.eos])) == 2


def test_qwen3_earlier_turns_are_learned_as_the_whole_conversation_renders_them(tmp_path):
    # Qwen3 writes an empty <think></think> block into the turns after the last user message
    # only: the conversation through turn 1 is not a prefix of the whole, the text before it is.
    d = build_dir(tmp_path / "q3", "qwen", "Qwen/Qwen3-0.6B", ["<think>", "</think>"])
    tk = make_tokenizer(str(d))
    ids, loss = flat(tk.pieces(chat_record(CHAT)), tk.specials)
    assert ids.tolist() == hf_ids(d, CHAT)
    eos, want = tk.specials.eos, np.zeros(len(ids), bool)
    for i in (2, 4):
        start = len(hf_ids(d, CHAT[:i], add_generation_prompt=True))
        end = start + ids[start:].tolist().index(eos) + 1
        want[start:end] = True
    np.testing.assert_array_equal(loss, want)
    assert tk.decode(ids[loss]).startswith("I'm fine, thank you.<|im_end|><think>\n\n</think>")


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_generation_prompt_and_tools_match_hf(dirs, family):
    tk = make_tokenizer(str(dirs[family]))
    for messages, tools in ((CHAT[:4], None), (CHAT[1:2], None), (CHAT[:2], TOOLS)):
        got = tk.prompt(messages, tools=tools).tolist()
        assert got == hf_ids(dirs[family], messages, add_generation_prompt=True, tools=tools)
    record = chat_record(CHAT[:4])  # the same prompt from a record: nothing learned
    ids, loss = flat(tk.pieces(record, generation=True), tk.specials)
    assert ids.tolist() == tk.prompt(CHAT[:4]).tolist() and not loss.any()


def test_template_date_is_what_strftime_now_renders(tmp_path):
    d = build_dir(tmp_path / "l32", "llama", "meta-llama/Llama-3.2-11B-Vision-Instruct")
    today = datetime.now().strftime("%Y-%m-%d")
    ours = make_tokenizer(str(d), template_date=today).prompt(CHAT[1:2])
    assert ours.tolist() == hf_ids(d, CHAT[1:2], add_generation_prompt=True)  # HF: today
    pinned = make_tokenizer(str(d), template_date="2024-07-26")
    assert "Today Date: 26 Jul 2024" in pinned.decode(pinned.prompt(CHAT[1:2]))


def test_image_rows_go_where_the_template_puts_the_image_pad(dirs, tmp_path):
    d = dirs["qwen-vl"]
    tk = make_tokenizer(str(d))
    pad, start, end = (tk.token_id(t) for t in QWEN_SPECIALS[6:7] + QWEN_SPECIALS[3:5])
    assert (tk.specials.media["vision"], tk.added_tokens) == (
        pad,
        {"<|jaxmllm_audio|>": tk.base_size},
    )
    parts = [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]
    messages = [{"role": "user", "content": parts}, CHAT[2]]
    record = chat_record(messages, images=["cat.png"])  # parsed as "<image>What is ..."
    ids, loss = flat(tk.pieces(record), tk.specials)
    assert ids.tolist() == hf_ids(d, messages)  # the template wraps the pad itself
    Image.new("RGB", (40, 24), (200, 30, 30)).save(tmp_path / "cat.png")
    cfg = load_config("configs/tiny.yaml", [f"data.tokenizer={d}"])
    pre = Preprocessor(Params.from_config(cfg), tk)
    record = parse_record({"id": "r", "messages": messages, "images": ["cat.png"]}, tmp_path, 1)
    sample = pre.sample(0, record, Sizes({"vision": [(24, 40)]}), Limits())
    rows = len(sample.media["vision"][0][0]) // cfg.model.vision.merge**2
    at = np.flatnonzero(sample.tokens == pad)
    assert len(at) == rows > 1 and np.all(np.diff(at) == 1)
    assert sample.tokens[at[0] - 1] == start and sample.tokens[at[-1] + 1] == end
    assert not sample.loss[at].any() and sample.loss.sum() == loss.sum()
    counts = pre.layout(record, Sizes({"vision": [(24, 40)]})).counts()
    assert counts["text"] == len(sample.tokens) - rows  # the index counts what training sees


def test_media_without_own_tokens_get_new_rows_and_text_records(dirs):
    tk = make_tokenizer(str(dirs["llama"]))
    image, audio = tk.specials.media["vision"], tk.specials.media["audio"]
    assert tk.added_tokens == {"<|jaxmllm_image|>": image, "<|jaxmllm_audio|>": audio}
    assert tk.vocab_size == tk.base_size + 2 == audio + 1
    record = parse_record(
        {"id": "t", "text": "<audio>Hello <image>there", "images": ["a"], "audio": ["b"]},
        Path("."),
        1,
    )
    ids, loss = flat(tk.pieces(record), tk.specials)
    oracle = hf(dirs["llama"])  # HF's tokenizer(text): its BOS, then the text
    bos = oracle("x")["input_ids"][0]
    hello, there = (oracle(t, add_special_tokens=False)["input_ids"] for t in ("Hello ", "there"))
    assert ids.tolist() == [bos, audio, *hello, image, *there, tk.specials.eos]
    assert loss[(ids != image) & (ids != audio)].all()  # pretraining text: all of it learned


def test_own_audio_placeholder_configured_image_token_and_legacy_specials(tmp_path):
    audio = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|IMG|>"]
    d = build_dir(
        tmp_path / "omni", "qwen", "Qwen/Qwen2.5-7B-Instruct", audio, image_token="<|IMG|>"
    )
    tk = make_tokenizer(str(d))
    assert tk.added_tokens == {}  # both placeholders are the checkpoint's own
    record = parse_record(
        {"id": "a", "text": "<audio>hi<image>", "audio": ["x"], "images": ["y"]}, Path("."), 1
    )
    ids, _ = flat(tk.pieces(record), tk.specials)
    wrapped = [tk.token_id(t) for t in audio[1:2] + audio[:1] + audio[2:3]]
    assert ids.tolist()[:3] == wrapped and tk.decode(ids[3:-2]) == "hi"
    assert ids[-2] == tk.specials.media["vision"] == tk.token_id("<|IMG|>")  # no wrap known
    assert tk.template.variables == hf(d).special_tokens_map  # image_token included
    # An older checkpoint: no added_tokens_decoder, named tokens in special_tokens_map.json.
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"], config["eos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    legacy = make_tokenizer(str(d))
    assert legacy.template.variables == hf(d).special_tokens_map
    assert legacy.specials.eos == tk.token_id("<|im_end|>")


def test_stop_ids_pad_and_pickling(dirs, tmp_path):
    d = build_dir(tmp_path / "g", "llama", "meta-llama/Llama-3.1-8B-Instruct")
    tk0 = make_tokenizer(str(d))
    end_of_text, eom = (tk0.token_id(t) for t in ("<|end_of_text|>", "<|eom_id|>"))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_of_text, eom]}))
    tk = make_tokenizer(str(d))
    assert tk.specials.stop == (tk.specials.eos, end_of_text, eom)
    assert tk.specials.pad == tk.specials.eos  # Llama 3 has no pad_token: eos pads
    qwen = make_tokenizer(str(dirs["qwen"]))
    assert qwen.specials.pad == qwen.token_id("<|endoftext|>") and qwen.specials.bos is None
    again = pickle.loads(pickle.dumps(qwen))  # worker processes reload the directory
    record = chat_record(CHAT)
    assert [p[1].tolist() for p in again.pieces(record)] == [
        p[1].tolist() for p in qwen.pieces(record)
    ]


def test_kinds_and_clear_errors(dirs, tmp_path):
    assert isinstance(make_tokenizer(str(dirs["qwen"] / "tokenizer.json")), HFTokenizer)
    assert isinstance(make_tokenizer(str(dirs["qwen"])), PretrainedTokenizer)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="empty has no tokenizer.json"):
        make_tokenizer(str(empty))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((dirs["qwen"] / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError, match="no tokenizer_config.json.*give the file's path"):
        make_tokenizer(str(bare))
    broken = build_dir(tmp_path / "broken", "qwen", None, chat_template="{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"broken/tokenizer_config.json.*does not compile"):
        make_tokenizer(str(broken))
    with pytest.raises(ConfigError, match="data.template_date"):
        load_config("configs/tiny.yaml", ["data.template_date=26 Jul 2024"])


def test_bad_records_are_rejected_with_the_file_and_record(dirs, tmp_path):
    raising = build_dir(tmp_path / "raise", "qwen", None)
    (raising / "chat_template.jinja").write_text(  # chat_template.jinja wins over the config
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tk = make_tokenizer(str(raising))
    with pytest.raises(RecordError, match=r"rec-1.*template_error.*chat_template.jinja.*no system"):
        tk.pieces(chat_record(CHAT))
    assert len(tk.pieces(chat_record(CHAT[1:]))) == 1
    # Only the last assistant turn gets its end token: not prefix-consistent.
    odd = build_dir(tmp_path / "odd", "qwen", None)
    (odd / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if loop.last %}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(RecordError, match=r"template_inconsistent.*before message 2 \(assistant"):
        make_tokenizer(str(odd)).pieces(chat_record(CHAT))
    injected = [{"role": "user", "content": "look: <|image_pad|>"}, CHAT[2]]
    with pytest.raises(RecordError, match="placeholder_mismatch.*1 <.image_pad.> .* 0 image"):
        make_tokenizer(str(dirs["qwen"])).pieces(chat_record(injected))
    bare = build_dir(tmp_path / "base", "qwen", None)  # a base checkpoint: text records only
    with pytest.raises(RecordError, match="template_error.*no chat template"):
        make_tokenizer(str(bare)).pieces(chat_record(CHAT))


def test_template_environment_is_transformers(dirs):
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}"
        "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}{{ m.content | trim }}"
        "{% endgeneration %}\n{% endfor %}{{ tools | tojson }}{{ dict(a=1) | tojson(indent=2) }}"
        "{{ ns.n }}{{ bos_token }}{{ eos_token }}"
    )
    tk = make_tokenizer(str(dirs["llama"]))
    variables = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    assert tk.template.variables == variables
    from jaxmllm.data.text.chat_template import ChatTemplate

    ours = ChatTemplate(source, "t", variables).render(CHAT, tools=TOOLS)
    (theirs,), _ = render_jinja_template([CHAT], tools=TOOLS, chat_template=source, **variables)
    assert ours == theirs and "<things> & 'stuff'" in ours


def test_index_and_batches_with_a_tokenizer_directory(dirs, tmp_path):
    """End to end through the data layer: the index counts what loading gives, and bucketize
    pads with the checkpoint's pad id and routes encoder rows to its own placeholder ids."""
    import wave

    from jaxmllm.data.index import build_index
    from jaxmllm.data.source import make_source
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.resolve.run import resolve_run

    Image.new("RGB", (48, 32), (10, 200, 30)).save(tmp_path / "a.png")
    with wave.open(str(tmp_path / "a.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(np.random.default_rng(0).normal(0, 3000, 8000).astype(np.int16).tobytes())
    parts = [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]
    user = [{"role": "user", "content": parts}, {"role": "user", "content": "<audio>Hello?"}]
    base = [
        {"id": "vl", "messages": [user[0], CHAT[2]], "images": ["a.png"]},
        {"id": "au", "messages": [user[1], CHAT[4]], "audio": ["a.wav"]},
        {"id": "tx", "text": "The quick brown fox <image>", "images": ["a.png"]},
        {"id": "bad", "messages": [CHAT[1], {"role": "assistant", "content": "<|image_pad|>!"}]},
    ]
    records = [{**r, "id": f"{r['id']}{k}"} for k, r in enumerate(base * 3)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tk = make_tokenizer(str(dirs["qwen-vl"]))
    cfg = load_config(
        "configs/manifest_example.yaml",
        [
            f"data.path={tmp_path / 'm.jsonl'}",
            f"data.tokenizer={dirs['qwen-vl']}",
            "data.workers=0",
            f"model.llm.vocab_size={tk.vocab_size}",
            "batch.llm_row_len=256",
        ],
    )
    summary = build_index(cfg, tmp_path / "m.jsonl", progress=False)
    assert summary["accepted"] == 9 and summary["rejects"] == {"placeholder_mismatch": 3}
    run = resolve_run(cfg)
    for i in range(len(run.index)):  # loading checks each sample against its index row
        assert run.source[i].loss.any()
    step = next(make_pipeline(run, prefetch=0))["batch"]
    tokens, seg = step["llm_tokens"], step["llm_segment_ids"]
    assert (tokens[seg == 0] == tk.specials.pad).all()
    vision, audio = step["llm_vision_src"] >= 0, step["llm_audio_src"] >= 0
    assert vision.any() and (tokens[vision] == tk.specials.media["vision"]).all()
    assert audio.any() and (tokens[audio] == tk.specials.media["audio"]).all()
    assert (
        (tokens == tk.specials.media["vision"]) == vision
    ).all()  # every placeholder slot filled
    with pytest.raises(ConfigError, match=f"vocab_size to at least {tk.vocab_size}"):
        make_source(replace_vocab(cfg, tk.vocab_size - 1))


def replace_vocab(cfg, vocab: int):
    from dataclasses import replace

    return replace(cfg, model=replace(cfg.model, llm=replace(cfg.model.llm, vocab_size=vocab)))


def test_the_index_sees_a_changed_directory_or_date(tmp_path):
    d = build_dir(tmp_path / "q", "qwen", "Qwen/Qwen2.5-7B-Instruct")
    sha = lambda *extra: (
        Params.from_config(
            load_config("configs/tiny.yaml", [f"data.tokenizer={d}", *extra])
        ).tokenizer_sha256
    )
    first = sha()
    assert sha("data.template_date=2025-01-01") != first
    (d / "chat_template.jinja").write_text(TEMPLATES["Qwen/Qwen2.5-VL-7B-Instruct"])
    assert sha() not in ("", first)
