"""data.mel: gemma4 computes Gemma4AudioFeatureExtractor's log-mel frames, and a clip counts as
many LLM tokens as Gemma4Processor gives it placeholders, whatever its length."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from jaxmllm.config import Config, from_dict
from jaxmllm.data.media.audio import gemma4_log_mel, load_audio
from jaxmllm.data.params import Params

pytest.importorskip("transformers")
# Samples: shorter than a frame's reach, on and off the hop (160), the 128-sample padding
# unit and a whole token (640); 29.99 s; past the processor's 30 s cut
LENGTHS = (161, 320, 480, 801, 1000, 1599, 16000, 16123, 479_840, 512_000)


def _processor_tokens(n: int) -> tuple[int, int]:
    """Gemma4Processor's soft tokens for a clip of n samples at 16 kHz: from its length
    (`_compute_audio_num_tokens`) and from the extractor's mask (`replace_audio_token`)."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    fe = Gemma4AudioFeatureExtractor()
    this = SimpleNamespace(feature_extractor=fe, audio_seq_length=750)
    counted = Gemma4Processor._compute_audio_num_tokens(this, np.zeros(n), 16000)
    marks = SimpleNamespace(boa_token="", eoa_token="", audio_token="A")
    inputs = fe([np.zeros(n, np.float32)], return_tensors="np")
    placed = Gemma4Processor.replace_audio_token(marks, inputs, 0).count("A")
    return counted, placed


def test_our_frames_are_the_feature_extractors():
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    fe, rng = Gemma4AudioFeatureExtractor(), np.random.default_rng(0)
    clips = [0.3 * rng.standard_normal(n).astype(np.float32) for n in (1000, 16123, 4481)]
    theirs = fe(clips, return_tensors="np")  # (a batch: padded, masked)
    for k, clip in enumerate(clips):
        ours = gemma4_log_mel(clip, 16000, 128)
        valid = theirs["input_features_mask"][k]
        assert len(ours) == valid.sum() and valid[: len(ours)].all()
        np.testing.assert_allclose(ours, theirs["input_features"][k][: len(ours)], atol=2e-4)


def test_a_clip_counts_the_processors_tokens_at_every_length():
    """Our frames per clip are 4 x the processor's tokens (its last token's frames past the
    clip padding), for clips off every grid; past 30 s the processor cuts the clip where we
    make chunks of data.audio_max_frames: the first chunk is its 750 tokens."""
    p = Params.from_config(from_dict(Config, {"data": {"mel": "gemma4"}}))
    assert p.audio_max_frames == 3000
    for n in LENGTHS:
        counted, placed = _processor_tokens(n)
        chunks = p.clip_chunks(n, 16000)
        assert counted == placed == chunks[0] // 4 == min(sum(chunks) // 4, 750), (n, chunks)


def test_a_loaded_clip_pads_its_last_token_at_position_minus_one(tmp_path):
    import soundfile

    from jaxmllm.data.media.kinds import Clips

    raw = {"data": {"mel": "gemma4"}, "model": {"audio": {"n_mels": 128}}}
    p = Params.from_config(from_dict(Config, raw))
    clip = 0.3 * np.random.default_rng(1).standard_normal(1599).astype(np.float32)
    soundfile.write(tmp_path / "a.wav", clip, 16000, subtype="FLOAT")
    ((frames, positions),) = Clips().load(p, str(tmp_path / "a.wav"), (1599, 16000), None, "r")
    valid = len(gemma4_log_mel(clip, 16000, 128))  # 9 frames: 3 tokens, 3 padding frames
    assert (len(frames), valid) == (12, 9)
    assert positions.tolist() == [*range(9), -1, -1, -1]
    np.testing.assert_array_equal(frames[:9], gemma4_log_mel(clip, 16000, 128))
    assert not frames[9:].any()
    again = load_audio(str(tmp_path / "a.wav"), 16000, 128, 4, 3000, mel="gemma4")
    np.testing.assert_array_equal(again[0], frames)
