"""Math rewards: \\boxed{} extraction, math-verify equivalence, final channel only, ReTool's tool-use bonus."""

import pytest

pytest.importorskip("math_verify")

from hf_gptoss_rl.harmony import CHANNEL, END, MESSAGE, RETURN, START, encode_text, parse_assistant_turn  # noqa: E402
from trl_ext.rewards import extract_boxed, is_equivalent, math_reward, retool_reward  # noqa: E402


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{a{b{c}}d}", "a{b{c}}d"),
        (r"first \boxed{1} then \boxed{\text{x}_{2}}", r"\text{x}_{2}"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed 5 dollars", "5"),
        (r"\fbox{3}", "3"),
        (r"\boxed{7} and a broken \boxed{8", "7"),
        (r"\boxed{unclosed", None),
        (r"\boxedx{2}", None),
        ("no box here", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("0.5", "1/2"),
        (r"\frac{1}{2}", "0.5"),
        (r"\dfrac{3}{4}", "0.75"),
        ("1,000", "1000"),
        ("72.0", "72"),
        ("x = 3", "3"),
        (r"\sqrt{2}", "2^{1/2}"),
        ("50\\%", "0.5"),
        ("(1,2)", "(1, 2)"),
    ],
)
def test_equivalent_answers(answer, truth):
    assert is_equivalent(answer, truth)
    assert math_reward(f"The answer is \\boxed{{{answer}}}.", truth) == 1.0


@pytest.mark.parametrize("answer, truth", [("2", "3"), ("0.51", "1/2"), (r"\frac{1}{3}", "0.3"), ("-72", "72")])
def test_wrong_answers(answer, truth):
    assert math_reward(f"\\boxed{{{answer}}}", truth) == 0.0


def test_no_final_or_no_box_scores_zero():
    assert math_reward(None, "4") == 0.0
    assert math_reward("The answer is 4.", "4") == 0.0  # the format requires a box


def _T(text):
    return encode_text(text)


def test_final_channel_only():
    """A boxed answer in the analysis channel earns nothing; the same answer in the final channel does."""
    analysis = [CHANNEL] + _T("analysis") + [MESSAGE] + _T(r"So it is \boxed{4}.") + [END, START] + _T("assistant")
    only_reasoning = parse_assistant_turn(
        analysis + [CHANNEL] + _T("final") + [MESSAGE] + _T("It is four-ish.") + [RETURN]
    )
    assert r"\boxed{4}" in only_reasoning.analysis
    assert math_reward(only_reasoning.final, "4") == 0.0
    answered = parse_assistant_turn(analysis + [CHANNEL] + _T("final") + [MESSAGE] + _T(r"\boxed{4}") + [RETURN])
    assert math_reward(answered.final, "4") == 1.0
    truncated = parse_assistant_turn(analysis + [CHANNEL] + _T("final") + [MESSAGE] + _T(r"\boxed{4}"))
    assert truncated.final is None and math_reward(truncated.final, "4") == 0.0


def test_retool_reward_formula():
    right, wrong = r"\boxed{4}", r"\boxed{5}"
    # verl scores a wrong answer min(-0.6, -1 + (messages - 2) / 2 * 0.1), counting the user prompt, the assistant
    # turns and the tool results: k tool round trips then an answer are 1 + (k + 1) + k = 2 + 2k messages
    assert retool_reward(right, "4", num_tool_calls=0) == 1.0
    assert retool_reward(right, "4", num_tool_calls=3) == 1.0
    assert retool_reward(wrong, "4", num_tool_calls=0) == -1.0  # 2 messages: -1 + (2 - 2) / 2 * 0.1
    assert retool_reward(wrong, "4", num_tool_calls=1) == pytest.approx(-0.9)  # 4 messages: -1 + (4 - 2) / 2 * 0.1
    assert retool_reward(wrong, "4", num_tool_calls=2) == pytest.approx(-0.8)  # 6 messages
    assert retool_reward(wrong, "4", num_tool_calls=9) == pytest.approx(-0.6)  # 20 messages: -0.1, capped at -0.6
    assert retool_reward(None, "4", num_tool_calls=2, tool_bonus=False) == -1.0
    with pytest.raises(ValueError, match="num_tool_calls"):
        retool_reward(wrong, "4", num_tool_calls=-1)


def test_rewards_in_worker_threads():
    """math-verify's signal-based timeouts only work in the main thread; rewards must work from executors too."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda a: math_reward(f"\\boxed{{{a}}}", "1/2"), ["0.5", "0.25"]))
    assert scores == [1.0, 0.0]
