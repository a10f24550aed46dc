"""From a wire request to its routing profile: text is measured in estimated tokens, not characters."""

from __future__ import annotations

import dataclasses
import statistics

from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from inference.pipeline import tokenizer
from inference.pipeline.textsize import SCAN_CHARS, estimated_tokens
from inference.profile import profile_of
from routing import Priority, Tier, TierPolicy, default_routing_config
from routing.complexity import ComplexityEstimator
from routing.config import CostModelConfig

# A Chinese product description of 403 characters (about as many tokens).
ZH = "轻便透气跑步鞋，网面鞋身，减震鞋底，适合日常训练与长距离慢跑。" * 13  # noqa: RUF001  (Chinese punctuation is the point)


def text_request(text: str) -> pb.InferRequest:
    return pb.InferRequest(model_name="text-encoder", kind=pb.REQUEST_KIND_TEXT, text=pb.TextQuery(text=text))


def real_tokens(text: str) -> int:
    return len(tokenizer.load(tokenizer.DEFAULT_TOKENIZER, 4096).encode(text).ids)


def is_cjk(text: str) -> bool:
    return any("\u3040" <= c <= "\u9fff" for c in text)


def test_text_profile_carries_the_token_estimate() -> None:
    """profile_of fills text_tokens with the pre-tokenizer estimate, and routing's text work is that."""
    for text in (ZH, "running shoes"):
        profile = profile_of(text_request(text), Priority.BATCH, None, "us-west")
        assert profile.text_chars == len(text)
        assert profile.text_tokens == estimated_tokens(text) > 0
        assert ComplexityEstimator(CostModelConfig()).work(profile) == profile.text_tokens
    # A reroute passes the estimate its WorkItem carries instead of counting again.
    again = profile_of(text_request(ZH), Priority.BATCH, None, "us-west", text_tokens=7)
    assert again.text_tokens == 7


def test_estimate_follows_the_tokenizer_in_every_script() -> None:
    """On the synthetic mix (queries and descriptions in eight languages) the estimate is within 10% of
    the tokenizer's count at the median for Chinese/Japanese and for the other languages alike, where
    characters / 4 puts Chinese and Japanese text at under half its tokens."""
    texts = [s.request.text.text for s in SyntheticTraffic(5).take(4000) if s.request.HasField("text")]
    for cjk in (True, False):
        group = [t for t in texts if is_cjk(t) == cjk]
        assert len(group) > 100
        real = [real_tokens(t) for t in group]
        estimate = statistics.median(estimated_tokens(t) / n for t, n in zip(group, real, strict=True))
        by_chars = statistics.median(len(t) / 4 / n for t, n in zip(group, real, strict=True))
        assert 0.9 <= estimate <= 1.1, (cjk, estimate)
        if cjk:
            assert by_chars < 0.5, by_chars


def test_long_chinese_text_goes_to_the_tier_its_tokens_call_for() -> None:
    """With the default thresholds, ~400 Chinese characters (~400 tokens) go to the cloud; counted as
    characters / 4 (~100 tokens), the same text would have stayed on the edge server."""
    policy = TierPolicy(default_routing_config())
    zh = profile_of(text_request(ZH), Priority.BATCH, None, "us-west")
    assert abs(zh.text_tokens - real_tokens(ZH)) <= 0.1 * real_tokens(ZH)
    assert policy.tier_for(zh).tier is Tier.CLOUD
    assert policy.tier_for(dataclasses.replace(zh, text_tokens=0)).tier is Tier.EDGE_SERVER


def test_long_text_is_estimated_from_its_start() -> None:
    """A long text costs the loop a bounded scan (SCAN_CHARS characters), scaled to its length: within 1%
    of the full count for a uniform text, and a 300,000-character text scores as what it is."""
    text = "ab " * 100_000
    assert len(text) > 100 * SCAN_CHARS
    assert abs(estimated_tokens(text) - (1 + 100_000)) <= 1_000
    zh_long = ZH * 20  # 8,060 characters: 8,060 tokens, counted on the first 2,048
    assert abs(estimated_tokens(zh_long) - (1 + len(zh_long))) <= 0.01 * len(zh_long)
