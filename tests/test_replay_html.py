"""The `asyncrl replay score` HTML report, opened in a real headless Chromium (tests/browser.py).

The checks read the DOM after the page's script built it: one span per token, each sampled token
coloured by the side of 1 its ratio lies on (or by |delta log-p|), masked tokens marked, token text that
spells HTML shown as text, the controls' view taken from the URL. One report is built by hand to hit
every case; one comes from a real recorded run re-scored by `replay.rescore`, and is what
docs/images/replay_report.png shows (`ASYNCRL_DOCS_IMAGES=1 pytest tests/test_replay_html.py -k recorded`
writes it again).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
from browser import Element, dump_dom, elements, require_chromium, screenshot
from loop_helpers import run_config, run_in_process
from PIL import Image
from replay_envs import EchoEnv

from asyncrl.policy.checkpoint import build_policy
from asyncrl.replay.html import embed_json, objective_bands, write_report
from asyncrl.replay.records import RolloutScore, TokenScore, TurnSummary
from asyncrl.replay.rescore import Series, rescore
from asyncrl.replay.run import RunView, Selection
from asyncrl.rollout.scoring import NativeScorer

pytestmark = pytest.mark.timeout(300)

BANDS = {"double_sided_is": (0.8, 1.28), "icepop_grpo": (0.5, 2.0)}
HOSTILE = "</script><b>x"
DOCS_IMAGE = Path(__file__).resolve().parents[1] / "docs/images/replay_report.png"
HUES = {"below": (33, 102, 172), "above": (178, 24, 43), "delta": (118, 42, 131)}


def decide(ratio: float) -> dict[str, str]:
    """What each objective does with `ratio` (the rule of learner/objectives/glm5.py, for hand-built data)."""
    side = "below" if ratio < 1 else "above"
    return {
        "double_sided_is": "kept" if 0.8 < ratio < 1.28 else side,
        "icepop_grpo": "kept" if 0.5 <= ratio <= 2.0 else side,
    }


def tokens(spec: list[tuple[int, str, float | None]], start: int = 0) -> list[TokenScore]:
    """(turn, text, ratio under `v2` or None for a token the policy did not sample) -> TokenScores."""
    out = []
    for i, (turn, text, ratio) in enumerate(spec):
        token = TokenScore(position=start + i, token_id=100 + i, text=text, turn=turn, sampled=ratio is not None)
        if ratio is not None:
            logp = -1.0 + (math.log(ratio) if 0 < ratio < math.inf else (math.inf if ratio > 0 else -math.inf))
            token.rollout_logprob, token.version, token.staleness, token.temperature = -1.0, 0, 2, 1.0
            token.logprobs, token.ratios = {"start": -1.0, "v2": logp}, {"start": 1.0, "v2": ratio}
            token.decisions = {"start": decide(1.0), "v2": decide(ratio)}  # type: ignore[dict-item]
        out.append(token)
    return out


def rollout(rollout_id: str, toks: list[TokenScore]) -> RolloutScore:
    turns = []
    for index in sorted({t.turn for t in toks}):
        own = [t for t in toks if t.turn == index and t.sampled]
        deltas = [abs(t.logprobs["v2"] - t.rollout_logprob) for t in own]  # type: ignore[operator]
        mean, largest = {"v2": sum(deltas) / len(deltas)}, {"v2": max(deltas)}
        turns.append(TurnSummary(index=index, sampled_tokens=len(own), mean_abs_delta=mean, max_abs_delta=largest))
    checkpoints = [{"label": "start", "version": 0, "path": None}, {"label": "v2", "version": 2, "path": "checkpoints/step-000002"}]
    sampled = [t for t in toks if t.sampled]
    masked = {label: {o: sum(t.decisions[label][o] != "kept" for t in sampled) / len(sampled) for o in BANDS} for label in ("start", "v2")}
    summary = {"sampled_tokens": len(sampled), "masked_fraction": masked, "kl": {"start||v2": 0.01}}
    return RolloutScore(rollout_id, 0, "coin", "ok", 1.0, "g0", 0.5, checkpoints, toks, turns, summary=summary)


def hand_built() -> list[RolloutScore]:
    first = tokens([
        (0, "<|user|>", None), (0, "1", None), (0, "2", None), (0, "<|assistant|>", None),
        (0, "4", 1.0), (0, HOSTILE, 0.5), (0, "\n", 0.9), (0, "<tool_call>", 1.0), (0, "p", 1.1), (0, "</tool_call>", 1.0001),
        (1, "<|observation|>", None), (1, "7", None), (1, "\n", None), (1, "<|assistant|>", None),
        (1, "7", 1.6), (1, "<|endoftext|>", 1.0),
        (2, "<|user|>", None), (2, "&amp;", None), (2, "k", 3.0),
    ])  # fmt: skip
    second = tokens([(0, "<|user|>", None), (0, "9", None), (0, "a", math.inf), (0, "b", 0.0), (0, "c", 0.79)])
    return [rollout("r-one", first), rollout("r-two", second)]


def rgb(style: str) -> tuple[int, int, int] | None:
    found = re.search(r"background-color:\s*rgb\((\d+),\s*(\d+),\s*(\d+)\)", style)
    return tuple(int(x) for x in found.groups()) if found else None  # type: ignore[return-value]


def strength(ratio: float, band: tuple[float, float]) -> float:
    """The report's rule: how far log(ratio) goes towards the band's edge on its side (1: at or past it)."""
    log_ratio = math.log(ratio) if ratio > 0 else -math.inf
    return min(1.0, abs(log_ratio / math.log(band[0] if log_ratio < 0 else band[1])))


def expected_side(ratio: float, band: tuple[float, float]) -> str:
    """Under 5% of the way to the band's edge is neutral."""
    return "neutral" if strength(ratio, band) < 0.05 else ("below" if ratio < 1 else "above")


def mixed(hue: tuple[int, int, int], t: float) -> tuple[int, ...]:
    """White blended towards `hue` by `t`."""
    return tuple(round(255 + (c - 255) * t) for c in hue)


def painted(ratio: float, band: tuple[float, float]) -> tuple[int, ...]:
    """The background a sampled token of this ratio gets: the hue of its side of 1, as strong as `strength`."""
    return mixed(HUES["below" if ratio < 1 else "above"], strength(ratio, band))


def close(colour: tuple[int, int, int] | None, expected: tuple[int, ...]) -> bool:
    return colour is not None and all(abs(a - b) <= 1 for a, b in zip(colour, expected, strict=True))


def token_spans(dom: str) -> list[Element]:
    return elements(dom, "span", "tok")


def test_embedded_json_cannot_close_its_script_and_reads_back():
    payload = {"text": HOSTILE + "<!-- & \u2028", "ratio": math.inf, "low": -math.inf, "nan": math.nan}
    text = embed_json(payload)
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"text": payload["text"], "ratio": "Infinity", "low": "-Infinity", "nan": "NaN"}


def test_report_in_chromium_shows_every_token_coloured_by_its_ratio(tmp_path):
    scores = hand_built()
    path = write_report(scores, tmp_path / "report.html", title="hand <built> & hostile", bands=BANDS, objective="double_sided_is")
    dom = dump_dom(path)
    assert 'data-ready="1"' in dom, "the page's script did not finish"
    spans = token_spans(dom)
    everything = [t for s in scores for t in s.tokens]
    assert len(spans) == len(everything)
    assert [s.text for s in spans] == [t.text for t in everything]
    assert [int(s.attrs["data-pos"]) for s in spans] == [t.position for t in everything]
    for span, token in zip(spans, everything, strict=True):
        assert span.attrs["data-sampled"] == ("1" if token.sampled else "0")
        if not token.sampled:
            assert span.attrs["data-side"] == "context" and rgb(span.attrs.get("style", "")) is None
            continue
        # Colour by `v2` (the last checkpoint) and the double-sided IS band (0.8, 1.28) by default.
        side = expected_side(token.ratios["v2"], BANDS["double_sided_is"])
        assert span.attrs["data-side"] == side, (token.text, token.ratios)
        assert close(rgb(span.attrs["style"]), painted(token.ratios["v2"], BANDS["double_sided_is"])), (token.text, span.attrs)
        decision = token.decisions["v2"]["double_sided_is"]
        assert span.attrs["data-decision"] == decision
        assert ("masked" in span.classes) == (decision != "kept") and (f"masked-{decision}" in span.classes) == (decision != "kept")
        assert "rollout log-p -1 \u00b7 version 0 \u00b7 staleness 2 \u00b7 temperature 1" in span.attrs["title"]
        assert f"token {token.token_id} {json.dumps(token.text)} \u00b7 position {token.position}" in span.attrs["title"]
    # Saturation at the band's edge: ratio 0.5 and 0.79 (past 0.8) are the full "below" hue, 1.6 and inf the full "above" one.
    by_text = {(s.attrs["data-pos"], s.text): s for s in spans}
    assert rgb(by_text[("5", HOSTILE)].attrs["style"]) == HUES["below"]
    assert "v2: log-p -1.693 \u00b7 ratio 0.5000 \u00b7 double_sided_is below, icepop_grpo kept" in by_text[("5", HOSTILE)].attrs["title"]
    assert rgb(by_text[("4", "c")].attrs["style"]) == HUES["below"]
    assert rgb(by_text[("14", "7")].attrs["style"]) == HUES["above"]
    assert rgb(by_text[("2", "a")].attrs["style"]) == HUES["above"]
    # Hostile text is text: no element came out of it, and the title was escaped.
    assert not elements(dom, "b") and HOSTILE in [s.text for s in spans]
    assert elements(dom, "title")[0].text == "hand <built> & hostile"
    assert "special" in by_text[("3", "<|assistant|>")].classes and "special" not in by_text[("17", "&amp;")].classes
    # What the browser paints: both saturated hues are on screen.
    image = Image.open(screenshot(path, tmp_path / "report.png", size=(1000, 700))).convert("RGB")
    shown = {colour for _, colour in image.getcolors(maxcolors=1 << 24)}
    assert HUES["below"] in shown and HUES["above"] in shown


def test_report_shows_turns_tool_calls_and_environment_blocks(tmp_path):
    scores = hand_built()
    dom = dump_dom(write_report(scores, tmp_path / "report.html", title="turns", bands=BANDS))
    sections = elements(dom, "section", "rollout")
    assert [s.attrs["data-rollout-id"] for s in sections] == ["r-one", "r-two"]
    first = sections[0]
    assert [e.text for e in _descendants(first) if "turn-sep" in e.classes] == ["turn 0", "turn 1", "turn 2"]
    blocks = [e for e in _descendants(first) if "block" in e.classes]
    assert [b.attrs["data-kind"] for b in blocks] == ["prompt", "completion", "env", "completion", "env", "completion"]
    # The environment's tokens of turn 1 are one boxed block, labelled, newline included.
    env = blocks[2]
    assert [t.text for t in _descendants(env) if "tok" in t.classes] == ["<|observation|>", "7", "\n", "<|assistant|>"]
    assert "tool output" in env.text
    toolcall = [e for e in _descendants(first) if "toolcall" in e.classes]
    assert len(toolcall) == 1 and [t.text for t in toolcall[0].children] == ["<tool_call>", "p", "</tool_call>"]
    rows = [e for e in _descendants(first) if e.tag == "tr" and "data-turn" in e.attrs]
    assert [[c.text for c in row.children][:3] for row in rows] == [["0", "6", "0"], ["1", "2", "0"], ["2", "1", "0"]]
    assert rows[0].children[4].text == f"{abs(math.log(0.5)):.4g}"
    assert "account" in first.text and "coin" in first.text and "kl[start||v2] 0.01" in first.text and "sampled_tokens 9" in first.text
    # Whole-rollout figures per checkpoint: one row each, a column per objective.
    table = next(e for e in _descendants(first) if "checkpoints" in e.classes)
    assert [c.text for c in table.children[0].children] == ["checkpoint", "masked double_sided_is", "masked icepop_grpo"]
    assert [[c.text for c in row.children] for row in table.children[1:]] == [["start", "0", "0"], ["v2", "0.3333", "0.1111"]]


def test_controls_in_the_url_pick_checkpoint_objective_and_delta_colouring(tmp_path):
    scores = hand_built()
    path = write_report(scores, tmp_path / "report.html", title="views", bands=BANDS)
    sampled = [t for s in scores for t in s.tokens if t.sampled]
    # Under `start` every ratio is 1: nothing coloured, nothing masked.
    spans = [s for s in token_spans(dump_dom(path, "checkpoint=start&objective=double_sided_is")) if s.attrs["data-sampled"] == "1"]
    assert len(spans) == len(sampled) and {s.attrs["data-side"] for s in spans} == {"neutral"}
    assert not any("masked" in s.classes for s in spans)
    # IcePop's wider band keeps 1.6 and colours it less than fully; |delta| colouring uses one hue whatever the side.
    spans = [s for s in token_spans(dump_dom(path, "checkpoint=v2&objective=icepop_grpo&color=delta")) if s.attrs["data-sampled"] == "1"]
    for span, token in zip(spans, sampled, strict=True):
        assert span.attrs["data-decision"] == token.decisions["v2"]["icepop_grpo"]
        delta = abs(token.logprobs["v2"] - token.rollout_logprob)
        assert span.attrs["data-side"] == ("neutral" if delta < 0.05 * math.log(2.0) else "delta"), (token.text, delta)
        assert close(rgb(span.attrs["style"]), mixed(HUES["delta"], min(1.0, delta / math.log(2.0)))), span.attrs  # one hue for both sides
    assert {s.attrs["data-decision"] for s in spans} == {"kept", "below", "above"}
    assert "masked" not in next(s for s in spans if s.text == "7").classes


def test_an_empty_report_loads(tmp_path):
    dom = dump_dom(write_report([], tmp_path / "empty.html", title="nothing selected"))
    assert 'data-ready="1"' in dom and not token_spans(dom) and "0 rollouts" in dom


def test_report_of_a_recorded_run(tmp_path, one_torch_thread):
    require_chromium()  # before the run, not after it
    config = run_config(tmp_path, "learner.checkpoint_every=1", "loop.steps=2", "loop.eval_every=100")
    asyncio.run(run_in_process(config, EchoEnv()))
    with RunView.open(tmp_path / config.name) as view:
        model, tokenizer, _ = build_policy(view.config.policy, view.config.seed)

        def scorer(ref):
            return NativeScorer(model if ref.path is None else ref.path)

        series = [Series("nearest", None), Series("final", view.final_checkpoint())]
        scores = rescore(view, view.select(Selection(status="ok", limit=8)), series, scorer, tokenizer)
        objective, bands, final = view.config.learner.objective.name, objective_bands(view.config.learner), view.final_checkpoint()
    path = write_report(scores, tmp_path / "report.html", title=f"asyncrl replay score {config.name}", bands=bands, objective=objective)
    assert final.version == 2 and len(scores) >= 4
    spans = token_spans(dump_dom(path, "checkpoint=nearest"))
    assert len(spans) == sum(len(s.tokens) for s in scores)
    sampled = [(span, token) for span, token in zip(spans, [t for s in scores for t in s.tokens], strict=True) if token.sampled]
    # Each token under the checkpoint of the version that sampled it: the engine's own log-probs, so no colour.
    assert sampled and {span.attrs["data-side"] for span, _ in sampled} == {"neutral"}
    spans = token_spans(dump_dom(path, "checkpoint=final"))
    sampled = [(span, token) for span, token in zip(spans, [t for s in scores for t in s.tokens], strict=True) if token.sampled]
    band = bands[objective]
    for span, token in sampled:
        assert span.attrs["data-side"] == expected_side(token.ratios["final"], band)
        assert close(rgb(span.attrs["style"]), painted(token.ratios["final"], band)), (token.text, span.attrs)
        assert span.attrs["data-decision"] == token.decisions["final"][objective]
    # Two steps at lr 1e-2 moved the policy: the final checkpoint disagrees visibly with some sampled tokens.
    assert {span.attrs["data-side"] for span, _ in sampled} - {"neutral"}
    out = screenshot(path, tmp_path / "report.png", "checkpoint=final&objective=double_sided_is")
    assert out.stat().st_size > 10_000
    if os.environ.get("ASYNCRL_DOCS_IMAGES") == "1":
        shutil.copyfile(out, DOCS_IMAGE)


def _descendants(element: Element):
    for child in element.children:
        yield child
        yield from _descendants(child)
