"""The soak's verdict on a run (soak.SoakResult.problems), from recorded prompts: no server needed."""
from unet_compiler.bench import soak


def _result(rss: list[float], prompts: int) -> soak.SoakResult:
    recs = [soak.SoakPrompt(i, 1, 64, 64, 0.5, 1.0, mib) for i, mib in enumerate(rss)]
    return soak.SoakResult("1x64x64, 4x128x128", recs, soak.baseline_prompt(prompts))


def test_baseline_waits_for_the_first_shapes():
    assert soak.baseline_prompt(20) == 10 and soak.baseline_prompt(200) == 20 and soak.baseline_prompt(1) == 1


def test_a_one_time_step_while_new_shapes_arrive_is_not_a_leak():
    # the 20-prompt CI run of 2026-11-24: +6 % by prompt 10 (new shapes), flat from there
    rss = [12767, 11911, 12060] + [12171] * 3 + [12500] * 4 + [12884] * 10 + [12871]
    assert _result(rss, 20).problems() == []


def test_a_copy_kept_per_prompt_is_a_leak():
    # 1.7 GB of fp16 UNet weights kept every few prompts, from the middle of the run on
    rss = [12000.0] * 11 + [12000.0 + 1700 * (i // 4 + 1) for i in range(10)]
    problems = _result(rss, 20).problems()
    assert len(problems) == 1 and "resident memory grew" in problems[0] and "from prompt 10" in problems[0], problems


def test_failures_recompiles_and_parity_are_reported():
    r = _result([100.0] * 21, 20)
    r.prompts[3].ok, r.prompts[3].error = False, "boom"
    r.prompts[4].events = [{"name": "unet_compiler.recompile", "shape": "2x64x64"}]
    r.prompts[5].eager_rel_l2 = 0.5
    text = "\n".join(r.problems())
    assert "prompt 3" in text and "boom" in text
    assert "1 recompile event" in text and "2x64x64" in text
    assert "(5, 0.5)" in text
