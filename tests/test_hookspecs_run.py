"""TrainingRun fires the lifecycle hooks in order; merge_kwargs merges plugin contributions."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

import pytest

from hookspecs import ShutdownReason, TrainingRun, get_plugin_manager, hookimpl, merge_kwargs


@pytest.fixture
def pm():
    return get_plugin_manager(load_entrypoints=False)


class Recorder:
    """Records every hook TrainingRun fires, with the arguments that identify the call."""

    def __init__(self, warmup: Any = None) -> None:
        self.warmup = warmup
        self.calls: list[tuple[Any, ...]] = []

    @hookimpl
    def mcgraph_configure(self, config, pluginmanager):
        self.calls.append(("configure", config))

    @hookimpl
    def mcgraph_model_config_kwargs(self, config):
        self.calls.append(("model_config_kwargs",))

    @hookimpl
    def mcgraph_rng_options(self, config):
        self.calls.append(("rng_options",))

    @hookimpl
    def mcgraph_rng_initialized(self, config):
        self.calls.append(("rng_initialized",))

    @hookimpl
    def mcgraph_model_build_context(self, config):
        self.calls.append(("model_build_context",))

    @hookimpl
    def mcgraph_model_built(self, model, optimizer, model_config, seq_length, micro_batch_size):
        self.calls.append(("model_built", seq_length, micro_batch_size))

    @hookimpl
    def mcgraph_forward_backward_func(self, forward_backward_func):
        self.calls.append(("forward_backward_func",))

    @hookimpl
    def mcgraph_warmup_steps(self, config):
        self.calls.append(("warmup_steps",))
        return self.warmup

    @hookimpl
    def mcgraph_train_start(self, start_step, train_iters):
        self.calls.append(("train_start", start_step, train_iters))

    @hookimpl
    def mcgraph_train_step_start(self, step):
        self.calls.append(("train_step_start", step))

    @hookimpl
    def mcgraph_post_warmup_step(self, step, start_step):
        self.calls.append(("post_warmup_step", step, start_step))

    @hookimpl
    def mcgraph_train_step_end(self, step, metrics):
        self.calls.append(("train_step_end", step, dict(metrics)))

    @hookimpl
    def mcgraph_evaluation_start(self, step):
        self.calls.append(("evaluation_start", step))

    @hookimpl
    def mcgraph_evaluation_end(self, step, metrics):
        self.calls.append(("evaluation_end", step, dict(metrics)))

    @hookimpl
    def mcgraph_shutdown(self, reason, exception):
        self.calls.append(("shutdown", reason, exception))

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


def fake_forward_backward(step: int) -> float:
    return 1.0 / (step + 1)


def run_fake_host(pm, *, train_iters: int, start_step: int = 0, config: Any = "cfg") -> TrainingRun:
    """A torch-free host loop calling TrainingRun the way a Megatron-Core loop does."""
    with TrainingRun(pm, config, train_iters=train_iters, start_step=start_step) as run:
        run.model_config_kwargs(base={"num_layers": 2})
        run.rng_options(base={"seed": 1234})
        run.rng_initialized()
        with run.model_build_context():
            model = [object()]
        run.model_built(
            model=model,
            optimizer=object(),
            model_config=object(),
            seq_length=8,
            micro_batch_size=2,
        )
        fwd_bwd = run.forward_backward_func(fake_forward_backward)
        for step in range(run.start_step, train_iters):
            with run.train_step(step) as metrics:
                metrics["loss"] = fwd_bwd(step)
        with run.evaluation() as metrics:
            metrics["val_loss"] = 0.5
    return run


# -- order ----------------------------------------------------------------------------------


def test_exact_hook_order_over_a_short_run(pm):
    rec = Recorder(warmup=2)
    pm.register(rec)
    before = signal.getsignal(signal.SIGTERM)

    run = run_fake_host(pm, train_iters=4)

    def step(n):
        return [("train_step_start", n), ("train_step_end", n, {"loss": 1.0 / (n + 1)})]

    assert rec.calls == [
        ("configure", "cfg"),
        ("model_config_kwargs",),
        ("rng_options",),
        ("rng_initialized",),
        ("model_build_context",),
        ("model_built", 8, 2),
        ("forward_backward_func",),
        ("warmup_steps",),
        ("train_start", 0, 4),
        *step(0),
        *step(1),
        ("train_step_start", 2),
        ("post_warmup_step", 2, 0),
        ("train_step_end", 2, {"loss": 1.0 / 3}),
        *step(3),
        ("evaluation_start", 3),
        ("evaluation_end", 3, {"val_loss": 0.5}),
        ("shutdown", ShutdownReason.COMPLETED, None),
    ]
    assert run.shutdown_reason is ShutdownReason.COMPLETED
    assert run.last_step == 3
    assert run.warmup_steps == 2
    assert signal.getsignal(signal.SIGTERM) == before, "SIGTERM handler not restored"


def test_configure_is_historic_for_plugins_registered_during_the_run(pm):
    late = Recorder()
    with TrainingRun(pm, "cfg", train_iters=0):
        pm.register(late)
    assert late.calls == [
        ("configure", "cfg"),
        ("shutdown", ShutdownReason.COMPLETED, None),
    ]


def test_plugin_registered_in_configure_gets_configure_once(pm):
    helper = Recorder()

    class Registrar:
        @hookimpl
        def mcgraph_configure(self, pluginmanager):
            pluginmanager.register(helper)

    pm.register(Registrar())
    run_fake_host(pm, train_iters=1)
    assert helper.names().count("configure") == 1
    assert helper.names()[0] == "configure"
    assert helper.names()[-1] == "shutdown"


def test_model_build_context_enters_every_manager_around_the_build(pm):
    events = []

    def plugin(label):
        class ContextPlugin:
            @hookimpl
            def mcgraph_model_build_context(self, config):
                @contextlib.contextmanager
                def ctx():
                    events.append(f"enter {label}")
                    yield
                    events.append(f"exit {label}")

                return ctx()

        return ContextPlugin()

    class NoContext:
        @hookimpl
        def mcgraph_model_build_context(self, config):
            return None

    pm.register(plugin("a"))
    pm.register(NoContext())
    pm.register(plugin("b"))
    with TrainingRun(pm, None, train_iters=0) as run, run.model_build_context():
        events.append("build DDP")
    # pluggy calls the last registered first; the exit stack unwinds in reverse.
    assert events == ["enter b", "enter a", "build DDP", "exit a", "exit b"]


def test_set_up_helpers_merge_plugin_contributions(pm):
    class Contributor:
        @hookimpl
        def mcgraph_model_config_kwargs(self, config):
            return {"cuda_graph_impl": config}

        @hookimpl
        def mcgraph_rng_options(self, config):
            return {"te_rng_tracker": True}

    pm.register(Contributor())
    with TrainingRun(pm, "local", train_iters=0) as run:
        assert run.model_config_kwargs(base={"num_layers": 2}) == {
            "num_layers": 2,
            "cuda_graph_impl": "local",
        }
        assert run.rng_options(base={"seed": 3}) == {"seed": 3, "te_rng_tracker": True}
        with pytest.raises(ValueError, match="te_rng_tracker"):
            run.rng_options(base={"te_rng_tracker": False})


# -- post-warmup step -----------------------------------------------------------------------


@pytest.mark.parametrize("start_step", [0, 7])
@pytest.mark.parametrize("warmup", [0, 1, 3, 4])
def test_post_warmup_fires_once_relative_to_start_step(pm, warmup, start_step):
    rec = Recorder(warmup=warmup)
    pm.register(rec)
    run_fake_host(pm, train_iters=start_step + 5, start_step=start_step)

    post = [call for call in rec.calls if call[0] == "post_warmup_step"]
    assert post == [("post_warmup_step", start_step + warmup, start_step)]
    index = rec.calls.index(post[0])
    assert rec.calls[index - 1] == ("train_step_start", start_step + warmup)
    assert rec.calls[index + 1][:2] == ("train_step_end", start_step + warmup)
    starts = [call[1] for call in rec.calls if call[0] == "train_step_start"]
    assert starts == list(range(start_step, start_step + 5))


@pytest.mark.parametrize("warmup", [5, 100])
def test_post_warmup_never_fires_when_training_ends_first(pm, warmup):
    rec = Recorder(warmup=warmup)
    pm.register(rec)
    run_fake_host(pm, train_iters=5)
    assert "post_warmup_step" not in rec.names()


def test_post_warmup_never_fires_when_no_plugin_answers(pm):
    rec = Recorder(warmup=None)
    pm.register(rec)
    run = run_fake_host(pm, train_iters=6)
    assert "warmup_steps" in rec.names()
    assert "post_warmup_step" not in rec.names()
    assert run.warmup_steps is None


def test_warmup_is_asked_once_per_run(pm):
    rec = Recorder(warmup=1)
    pm.register(rec)
    run_fake_host(pm, train_iters=4)
    assert rec.names().count("warmup_steps") == 1
    assert rec.names().count("train_start") == 1


def test_each_run_warms_up_again(pm):
    """A second run in the same process (a resume) gets its own post-warmup step."""
    rec = Recorder(warmup=1)
    pm.register(rec)
    run_fake_host(pm, train_iters=3)
    pm2 = get_plugin_manager(load_entrypoints=False)
    pm2.register(rec)
    run_fake_host(pm2, train_iters=6, start_step=3)
    post = [call for call in rec.calls if call[0] == "post_warmup_step"]
    assert post == [("post_warmup_step", 1, 0), ("post_warmup_step", 4, 3)]


def test_a_plugin_manager_serves_one_run(pm):
    """configure is historic: reusing a manager would replay the old run's configuration."""
    run_fake_host(pm, train_iters=1)
    with pytest.raises(RuntimeError, match="already served a TrainingRun"):
        with TrainingRun(pm, None, train_iters=1):
            pass


def test_post_warmup_fires_once_even_if_the_host_retries_the_capture_step(pm):
    """The spec says "fired exactly once per run". A step that raised is not finished, so
    a host that catches the error may run the same step again; today the retry fires
    mcgraph_post_warmup_step a second time (run.py, ``train_step``: no fired-once flag)."""
    rec = Recorder(warmup=1)
    pm.register(rec)
    with TrainingRun(pm, None, train_iters=3) as run:
        step, failed_once = 0, False
        while step < 3:
            try:
                with run.train_step(step):
                    if step == 1 and not failed_once:
                        failed_once = True
                        raise RuntimeError("transient error in the capture step")
            except RuntimeError:
                continue
            step += 1
    assert [call for call in rec.calls if call[0] == "post_warmup_step"] == [
        ("post_warmup_step", 1, 0)
    ]


@pytest.mark.parametrize(
    ("start_step", "steps"),
    [
        (0, [0, 2]),  # a skipped step
        (0, [1]),  # not starting at start_step
        (5, [0]),  # ignoring start_step
        (0, [0, 0]),  # a repeated step
        (0, [0, 1, 0]),  # going back
    ],
)
def test_non_consecutive_steps_raise(pm, start_step, steps):
    rec = Recorder(warmup=0)
    pm.register(rec)
    with pytest.raises(ValueError, match="consecutive"):
        with TrainingRun(pm, None, train_iters=10, start_step=start_step) as run:
            for step in steps:
                with run.train_step(step):
                    pass
    assert rec.calls[-1][:2] == ("shutdown", ShutdownReason.EXCEPTION)
    assert isinstance(rec.calls[-1][2], ValueError)
    assert rec.names().count("shutdown") == 1


@pytest.mark.parametrize("inner", [0, 1])
def test_a_train_step_entered_inside_another_is_refused(pm, inner):
    """A host helper that wraps the step body in run.train_step while the loop already
    does: the step hooks must not fire twice for one step (nor a step start inside one)."""
    rec = Recorder(warmup=5)
    pm.register(rec)
    with pytest.raises(RuntimeError) as excinfo:
        with TrainingRun(pm, None, train_iters=3) as run:
            with run.train_step(0):
                with run.train_step(inner):
                    pass
    assert str(excinfo.value).startswith(
        f"TrainingRun.train_step(step={inner}) entered while step 0 is still running; "
    )
    assert [call for call in rec.calls if call[0].startswith("train_step")] == [
        ("train_step_start", 0)
    ]
    assert rec.calls[-1] == ("shutdown", ShutdownReason.EXCEPTION, excinfo.value)
    assert run.last_step is None


class FailsOnce:
    """Raises ``exc`` from the start hook of ``step``, once."""

    def __init__(self, step: int, exc: BaseException) -> None:
        self.step, self.exc = step, exc

    @hookimpl
    def mcgraph_train_step_start(self, step):
        if step == self.step and self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc


@pytest.mark.parametrize("where", ["body", "start hook"])
def test_a_step_that_failed_is_no_longer_running(pm, where):
    """Both ways a step can fail leave no step running: the host may run it again, and
    the next steps run (an exception type of its own: not a RuntimeError the refusal of a
    step entered inside another would be taken for)."""

    class StepFailed(Exception):
        pass

    rec = Recorder(warmup=0)
    pm.register(rec)
    if where == "start hook":
        pm.register(FailsOnce(1, StepFailed()))
    with TrainingRun(pm, None, train_iters=3) as run:
        failures = 0
        step = 0
        while step < 3:
            try:
                with run.train_step(step):
                    if where == "body" and step == 1 and not failures:
                        raise StepFailed
            except StepFailed:
                failures += 1
                continue
            step += 1
    assert failures == 1
    assert [call[1] for call in rec.calls if call[0] == "train_step_end"] == [0, 1, 2]
    assert run.shutdown_reason is ShutdownReason.COMPLETED


class Index:
    """An integer of another kind (``__index__``), as numpy's are."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize("bad", [0.0, 1.0, False, "0", None, [0]], ids=repr)
def test_a_step_that_is_not_an_integer_is_refused(pm, bad):
    """0.0 == 0 and False == 0: without the type test they pass the step check, and the
    float reaches the plugins (the CUDA graph plugin's timer fails with a TypeError)."""
    rec = Recorder(warmup=0)
    pm.register(rec)
    with pytest.raises(TypeError) as excinfo:
        with TrainingRun(pm, None, train_iters=2) as run:
            with run.train_step(bad):
                pass
    assert str(excinfo.value).startswith(
        f"TrainingRun.train_step: step must be an integer, got {bad!r} ({type(bad).__name__}); "
    )
    assert "train_step_start" not in rec.names()
    assert rec.calls[-1] == ("shutdown", ShutdownReason.EXCEPTION, excinfo.value)


def test_integer_steps_of_other_kinds_reach_the_hooks_as_ints(pm):
    np = pytest.importorskip("numpy")
    rec = Recorder(warmup=1)
    pm.register(rec)
    with TrainingRun(pm, None, train_iters=np.int64(4), start_step=np.int32(1)) as run:
        for step in [np.int64(1), Index(2), 3]:
            with run.train_step(step):
                pass
    assert (run.start_step, run.train_iters) == (1, 4)
    assert type(run.start_step) is int and type(run.train_iters) is int
    steps = [call[1:] for call in rec.calls if call[0].startswith(("train", "post"))]
    assert steps == [(1, 4), (1,), (1, {}), (2,), (2, 1), (2, {}), (3,), (3, {})]
    assert all(type(arg) is int for call in steps for arg in call if not isinstance(arg, dict))
    assert run.shutdown_reason is ShutdownReason.COMPLETED


@pytest.mark.parametrize(
    "kwargs,name,value",
    [
        (dict(train_iters=2.5), "train_iters", 2.5),
        (dict(train_iters=3.0), "train_iters", 3.0),
        (dict(train_iters="3"), "train_iters", "3"),
        (dict(train_iters=True), "train_iters", True),
        (dict(train_iters=3, start_step=1.0), "start_step", 1.0),
        (dict(train_iters=3, start_step=False), "start_step", False),
        (dict(train_iters=3, start_step=None), "start_step", None),
    ],
)
def test_train_iters_and_start_step_must_be_integers(pm, kwargs, name, value):
    with pytest.raises(TypeError) as excinfo:
        TrainingRun(pm, None, **kwargs)
    assert str(excinfo.value).startswith(
        f"TrainingRun: {name} must be an integer, got {value!r} ({type(value).__name__}); "
        f"pass {name} as an int"
    )


@pytest.mark.parametrize("answer", [-1, True, False, "2", 1.5, [1]])
def test_bad_warmup_answer_raises(pm, answer):
    rec = Recorder(warmup=answer)
    pm.register(rec)
    with pytest.raises(ValueError, match="mcgraph_warmup_steps answered") as excinfo:
        run_fake_host(pm, train_iters=3)
    assert repr(answer) in str(excinfo.value)
    assert f"answered {answer!r} (answered by plugin 'Recorder');" in str(excinfo.value)
    assert "train_step_start" not in rec.names()
    assert rec.calls[-1] == ("shutdown", ShutdownReason.EXCEPTION, excinfo.value)


def test_train_step_end_sees_the_metrics_the_host_filled(pm):
    rec = Recorder()
    pm.register(rec)
    run_fake_host(pm, train_iters=2)
    ends = [call for call in rec.calls if call[0] == "train_step_end"]
    assert ends == [("train_step_end", 0, {"loss": 1.0}), ("train_step_end", 1, {"loss": 0.5})]


def test_start_step_must_not_exceed_train_iters(pm):
    with pytest.raises(ValueError, match="start_step"):
        TrainingRun(pm, None, train_iters=3, start_step=4)
    with pytest.raises(ValueError, match="start_step"):
        TrainingRun(pm, None, train_iters=3, start_step=-1)


# -- merge_kwargs ---------------------------------------------------------------------------


def test_merge_kwargs_merges_in_order():
    assert merge_kwargs([{"a": 1}, {"b": 2}], "X") == {"a": 1, "b": 2}
    assert list(merge_kwargs([{"b": 2}, {"a": 1}], "X")) == ["b", "a"]


def test_merge_kwargs_skips_none_and_empty():
    assert merge_kwargs([None, {"a": 1}, None, {}], "X") == {"a": 1}
    assert merge_kwargs([], "X") == {}
    assert merge_kwargs([None], "X", base=None) == {}


def test_merge_kwargs_starts_from_base_without_mutating_it():
    base = {"seed": 1}
    merged = merge_kwargs([{"te_rng_tracker": True}], "X", base=base)
    assert merged == {"seed": 1, "te_rng_tracker": True}
    assert base == {"seed": 1}


def test_merge_kwargs_accepts_agreeing_values():
    assert merge_kwargs([{"a": 1}, {"a": 1}], "X", base={"a": 1}) == {"a": 1}


@pytest.mark.parametrize(
    ("results", "base"),
    [
        ([{"cuda_graph_impl": "local"}, {"cuda_graph_impl": "transformer_engine"}], None),
        ([{"cuda_graph_impl": "local"}], {"cuda_graph_impl": "none"}),
        ([None, {"cuda_graph_impl": 1}, {"other": 2, "cuda_graph_impl": 2}], None),
    ],
)
def test_merge_kwargs_conflict_names_the_key_and_the_target(results, base):
    with pytest.raises(ValueError, match=r"TransformerConfig: .*'cuda_graph_impl'"):
        merge_kwargs(results, "TransformerConfig", base=base)


def test_per_run_plugin_with_an_unknown_hook_is_refused_after_configure(pm):
    """check_pending() also covers plugins registered while configuring."""
    import pluggy

    from hookspecs import hookimpl as impl

    class Typo:
        @impl
        def mcgraph_train_step_ned(self, step):  # misspelled on purpose
            pass

    class Registers:
        @impl
        def mcgraph_configure(self, config, pluginmanager):
            pluginmanager.register(Typo())

    shutdowns = []

    class Watch:
        @impl
        def mcgraph_shutdown(self, reason, exception):
            shutdowns.append(str(reason))

    pm.register(Registers(), name="steptimer")
    pm.register(Watch())
    with pytest.raises(pluggy.PluginValidationError, match="mcgraph_train_step_ned") as raised:
        with TrainingRun(pm, None, train_iters=1):
            pass
    assert shutdowns == ["exception"]
    # (review of 2026-12-05: the object was named by its repr, "<...Typo object at 0x...>")
    assert raised.value.__notes__[0] == (
        "registered as 'steptimer:Typo', of plugin 'steptimer'; did you mean "
        "mcgraph_train_step_end?"
    )


class PaddingListener:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    @hookimpl
    def mcgraph_step_padded(self, step, seq_length, real_tokens, padded_tokens):
        self.calls.append((step, seq_length, real_tokens, padded_tokens))


def test_step_padded_between_steps_is_refused_naming_where_to_call_it(pm):
    """(review of 2026-12-05: a call between steps 1 and 2 was counted to step 2, and bucket
    16's padding waste read 94.4 % where its steps had 37.5 %.)"""
    listener = PaddingListener()
    pm.register(listener)
    with TrainingRun(pm, None, train_iters=3) as run:
        with run.train_step(0):
            run.step_padded(seq_length=16, real_tokens=10, padded_tokens=6)
        with pytest.raises(RuntimeError) as excinfo:
            run.step_padded(seq_length=16, real_tokens=1, padded_tokens=15)
        with run.train_step(1):
            run.step_padded(seq_length=16, real_tokens=8, padded_tokens=8)
            run.step_padded(seq_length=16, real_tokens=9, padded_tokens=7)  # (per micro-batch)
    assert str(excinfo.value).startswith(
        "TrainingRun.step_padded called between steps (the next is step 1): it counts for the "
        "step whose training call takes the padded micro-batches"
    )
    assert "Fix: call it inside `with run.train_step(step)`" in str(excinfo.value)
    assert listener.calls == [(0, 16, 10, 6), (1, 16, 8, 8), (1, 16, 9, 7)]


def test_step_padded_takes_whole_counts_as_ints_and_refuses_fractions_and_negatives(pm):
    """(review of 2026-12-05: ``real_tokens=loss_mask.sum()`` trained every step, then the
    report's JSON write failed at shutdown, "Object of type Tensor is not JSON
    serializable"; ``padded_tokens=None`` failed inside the plugin on step 0.) A float
    mask's sum, megatron-core's loss mask, is a whole number: taken."""
    torch = pytest.importorskip("torch")
    listener = PaddingListener()
    pm.register(listener)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    with TrainingRun(pm, None, train_iters=1) as run:
        with run.train_step(0):
            run.step_padded(
                seq_length=torch.tensor(4), real_tokens=mask.sum(), padded_tokens=(1 - mask).sum()
            )
            run.step_padded(seq_length=4, real_tokens=3.0, padded_tokens=(1 - mask).long().sum())
            for kwargs, said in [
                (dict(real_tokens=mask.sum() / 2), "real_tokens must be a whole number, got"),
                (dict(padded_tokens=None), "padded_tokens must be a whole number, got None"),
                (dict(padded_tokens="1"), "padded_tokens must be a whole number, got '1'"),
                (dict(real_tokens=mask), "real_tokens must be a whole number, got tensor("),
                (dict(seq_length=4.0), "seq_length must be an integer, got 4.0 (float)"),
            ]:
                args = dict(seq_length=4, real_tokens=3, padded_tokens=1) | kwargs
                with pytest.raises(TypeError, match=r"TrainingRun\.step_padded: ") as excinfo:
                    run.step_padded(**args)
                assert said in str(excinfo.value)
            for kwargs, said in [
                (dict(padded_tokens=-1), "padded_tokens=-1: "),
                (dict(seq_length=0, real_tokens=-2), "seq_length=0, real_tokens=-2: "),
            ]:
                args = dict(seq_length=4, real_tokens=3, padded_tokens=1) | kwargs
                with pytest.raises(ValueError) as excinfo:
                    run.step_padded(**args)
                assert str(excinfo.value).startswith(f"TrainingRun.step_padded: {said}")
    assert listener.calls == [(0, 4, 3, 1), (0, 4, 3, 1)]
    assert all(type(value) is int for call in listener.calls for value in call)


# -- answers that a run uses, checked where it takes them, naming who answered -------------


class Answers:
    """A plugin giving the answers set on it (None: no implementation result)."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers

    @hookimpl
    def mcgraph_model_config_kwargs(self, config):
        return self.answers.get("kwargs")

    @hookimpl
    def mcgraph_rng_options(self, config):
        return self.answers.get("rng")

    @hookimpl
    def mcgraph_model_build_context(self, config):
        return self.answers.get("context")

    @hookimpl(wrapper=True)
    def mcgraph_forward_backward_func(self, forward_backward_func):
        given = yield
        return self.answers.get("fbf", given)


@contextlib.contextmanager
def _build_context():
    yield


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ([("hidden_dropout", 0.0)], "TransformerConfig: a plugin answered [('hidden_dropout', "
         "0.0)] (list), not a dict of keyword arguments (answered by plugin 'bad'); answer a "
         "dict, or None for nothing"),
        ("", "TransformerConfig: a plugin answered '' (str), not a dict"),  # (falsy: skipped)
        ({"hidden_dropout": 0.0}, "TransformerConfig: conflicting values for 'hidden_dropout': "
         "the host's 0.1 and a plugin's 0.0 (answered by plugin 'bad'); make the host and its "
         "plugins agree on 'hidden_dropout'"),
    ],
)  # fmt: skip
def test_a_bad_kwargs_answer_names_the_value_and_the_plugin(pm, answer, said):
    """(review of 2026-12-05: a list failed inside the merge, "'list' object has no
    attribute 'items'", a falsy non-dict was dropped, and a conflict named neither side.)"""
    pm.register(Answers(kwargs=answer), name="bad")
    with TrainingRun(pm, None, train_iters=0) as run:
        with pytest.raises((TypeError, ValueError)) as excinfo:
            run.model_config_kwargs(base={"hidden_dropout": 0.1})
    assert str(excinfo.value).startswith(said), str(excinfo.value)


def test_with_two_implementations_every_plugin_that_may_have_answered_is_named(pm):
    pm.register(Answers(rng={"seed": 1}), name="one")
    pm.register(Answers(rng={"seed": 2}), name="two")
    with TrainingRun(pm, None, train_iters=0) as run:
        with pytest.raises(ValueError) as excinfo:
            run.rng_options()
    assert str(excinfo.value) == (
        "model_parallel_cuda_manual_seed: conflicting values for 'seed': a plugin's 2 and a "
        "plugin's 1 (implemented by plugins 'two', 'one'); make the host and its plugins agree "
        "on 'seed'"
    )


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (_build_context, "mcgraph_model_build_context answered <function _build_context at "),
        (3, "mcgraph_model_build_context answered 3 (int), not a context manager (answered by "
         "plugin 'bad'); answer one, or None for nothing"),
    ],
)  # fmt: skip
def test_a_build_context_that_is_no_context_manager_is_named(pm, answer, said):
    """(review of 2026-12-05: "'builtins.int' object does not support the context manager
    protocol", no plugin named; the @contextmanager function itself, uncalled, the same.)"""
    pm.register(Answers(context=answer), name="bad")
    with TrainingRun(pm, None, train_iters=0) as run:
        with pytest.raises(TypeError) as excinfo:
            with run.model_build_context():
                pass
    assert str(excinfo.value).startswith(said), str(excinfo.value)
    if callable(answer):
        assert str(excinfo.value).endswith(
            "return the context manager, not the function that makes it (call it: `return "
            "build_context()`)"
        )
    good = get_plugin_manager(load_entrypoints=False)
    good.register(Answers(context=_build_context()), name="good")
    with TrainingRun(good, None, train_iters=0) as run:
        with run.model_build_context():
            pass


@pytest.mark.parametrize("answer", [None, 3])
def test_a_forward_backward_answer_that_is_not_callable_fails_where_it_is_taken(pm, answer):
    """(review of 2026-12-05: ``None`` was handed to the host, and failed at step 0 as
    "'NoneType' object is not callable", in another plugin's frame.)"""
    pm.register(Answers(fbf=answer), name="bad")

    def fwd_bwd(**kwargs):
        return []

    with TrainingRun(pm, None, train_iters=0) as run:
        with pytest.raises(TypeError) as excinfo:
            run.forward_backward_func(fwd_bwd)
    assert str(excinfo.value).startswith(
        f"mcgraph_forward_backward_func answered {answer!r} ({type(answer).__name__}) for "
        f"{fwd_bwd!r}, not a callable (answered by plugin 'bad'); a wrapper answers"
    )


def test_a_callable_the_host_did_not_give_is_the_host_s_not_a_plugin_s(pm):
    """(review of this session's diff: ``run.forward_backward_func(None)`` through a
    pass-through wrapper said "answered by plugin 'timer'".)"""
    pm.register(Answers(), name="timer")  # its wrapper answers what it got
    with TrainingRun(pm, None, train_iters=0) as run:
        with pytest.raises(TypeError) as excinfo:
            run.forward_backward_func(None)
    assert str(excinfo.value) == (
        "run.forward_backward_func was given None (NoneType), not a callable; pass "
        "megatron-core's get_forward_backward_func()"
    )


def test_merge_kwargs_takes_any_mapping():
    """(review of this session's diff: the new type check refused a MappingProxyType.)"""
    from types import MappingProxyType

    assert merge_kwargs([MappingProxyType({"a": 1}), None], "X") == {"a": 1}


def test_model_built_a_second_time_is_refused_naming_the_call(pm):
    """(user trial, 2026-12-05: the second call reached the plugin's state machine, "cannot
    go from built to built", which named neither the call nor the fix.)"""
    built = dict(model=[object()], optimizer=object(), model_config=object())
    with TrainingRun(pm, "cfg", train_iters=1) as run:
        run.model_built(**built, seq_length=8, micro_batch_size=2)
        with pytest.raises(RuntimeError, match=r"run\.model_built\(\) was called a second time"):
            run.model_built(**built, seq_length=8, micro_batch_size=2)
