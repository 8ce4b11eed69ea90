"""A chapter judges its own timings: a median whose steps spread wide, or a run on a busy CPU,
is said not to be trusted where the number shows (tables, figures, the report's findings)."""
from types import SimpleNamespace

from kit.measure.timing import (load_warning, spread_warning, verdict_line, warnings_of)
from kit.pages.findings import decode
from kit.show import plots
from kit.show.judgement import marked, marked_title
from kit.show.tables import Table

QUIET = [0.00100, 0.00102, 0.00098, 0.00101, 0.00099, 0.00110, 0.00097, 0.00103, 0.00100, 0.00105]
# a quiet run's steps (chapter 04's stock strategy, the 2-core EPYC with nothing else running,
# ms): its first steps of each round slower, p10-p90 about 68% of the median
QUIET_EPYC = [x / 1e3 for x in (4.717, 4.142, 4.461, 4.225, 3.051, 2.711, 2.693, 2.746, 2.807,
                                 2.759, 2.462, 2.851, 2.88, 2.699, 2.677)]
# the busy run: a median of hundreds of ms, p10 about 2 ms, p90 about 400 ms
BUSY = [0.002, 0.0021, 0.21, 0.25, 0.31, 0.312, 0.39, 0.42, 0.45, 0.002]


def test_the_spread_says_when_a_median_is_not_to_be_trusted():
    assert spread_warning(QUIET) is None and spread_warning(QUIET_EPYC) is None
    why = spread_warning(BUSY)
    assert why.startswith("p10–p90 2.00–450.00 ms around a 280.00 ms median"), why


def test_the_load_counts_only_work_beyond_the_runs_own_threads():
    quiet = {"before": (3.4, 1.5, 0.6), "after": (2.6, 1.2, 0.8)}  # the run's own 2 threads
    busy = {"before": (1.2, 1.0, 0.9), "after": (3.4, 2.0, 1.0)}   # and a core taken
    assert load_warning(quiet, threads=2) is None
    assert load_warning(busy, threads=2) == \
        "load average 3.4 with 2 threads of its own: other work shared the CPU"
    assert load_warning({}, threads=2) is None


def test_the_verdict_names_what_is_not_to_be_trusted_and_what_to_do():
    assert verdict_line({}).startswith("Timings steady")
    line = verdict_line({"eager": "p10–p90 ...", "the machine": "load average 3.4 ..."})
    assert line == ("Not to be trusted (close other work and run the cell again): the machine: "
                    "load average 3.4 ...; 1 median(s) whose steps spread wider than 1.5 times "
                    "them (eager; eager: p10–p90 ...).")
    many = verdict_line({f"s{i}": "wide" for i in range(20)})
    assert "20 median(s)" in many and "(s0, s1, s2 and 17 more; s0: wide)" in many
    curve = SimpleNamespace(timing_warnings=lambda: {"tiny, batch 4": "p10–p90 ..."})
    assert warnings_of([curve], "busy") == {"the machine": "busy", "tiny, batch 4": "p10–p90 ..."}
    assert warnings_of([SimpleNamespace(timing_warnings=dict)]) == {}


def test_tables_and_figures_mark_what_is_not_to_be_trusted():
    assert marked("312.40", None) == "312.40" and marked("312.40", "busy") == "312.40 ⚠"
    assert marked_title("t", {}) == "t" and "⚠: a median not to be trusted" in \
        marked_title("t", {"eager": "x"})
    assert marked_title("", {"eager": "x"}).startswith("⚠: a median")
    fig = plots.measured_vs_published([("a", 1.0, 1.1)], "Guards", {"stock": "x"})
    assert "⚠ not to be trusted: stock" in fig.layout.title.text
    assert plots.measured_vs_published([("a", 1.0, 1.1)], "Guards").layout.title.text == "Guards"
    assert "⚠" in repr(Table([{"median ms": marked("1.00", "x")}], marked_title("", {"x": 1})))


def test_the_report_says_what_chapter_04_says():
    """One number and one wording: the floor ÷ the step as the chapter's tables show it, and
    the chapter's own warnings beside it."""
    results = {"best_strategy": "guard_free", "floor_seconds": [0.0008],
               "strategies": {"guard_free": {"median_step_seconds": 0.00153,
                                             "percent_of_floor": 52.3}}}
    [finding] = decode(results)
    assert finding.found == "1.53 ms, floor ÷ step 52%"
    results["timing_warnings"] = {"guard_free": "p10–p90 2.00–450.00 ms around a 281 ms median"}
    [finding] = decode(results)
    assert finding.found.startswith("1.53 ms, floor ÷ step 52% ⚠ not to be trusted (guard_free: ")
