"""A Coordinator that runs in the test process (no Ray): its worker actors are the real
TargetWorker / DraftWorker classes behind a stand-in whose `.remote()` runs the method at once
and returns an awaitable, so the coordinator's loop, admission, cache-miss protocol and pipeline
run unchanged. conftest.py's `local_coordinator` fixture hands out `patch_coordinator`'s maker."""
from __future__ import annotations

from specserve.config import AppConfig


class _Done:
    """What `.remote()` returns here: an awaitable holding the method's result (or its error)."""

    def __init__(self, fn, args, kwargs) -> None:
        try:
            self.value, self.error = fn(*args, **kwargs), None
        except Exception as err:  # raised when awaited, as Ray would
            self.value, self.error = None, err

    def __await__(self):
        if False:
            yield
        if self.error is not None:
            raise self.error
        return self.value


def _value(ref):
    if isinstance(ref, list):  # ray.get of several refs
        return [_value(r) for r in ref]
    if not isinstance(ref, _Done):
        return ref
    if ref.error is not None:
        raise ref.error
    return ref.value


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args, **kwargs) -> _Done:
        return _Done(self.fn, args, kwargs)


class LocalActor:
    """A worker object whose methods are called as `actor.method.remote(...)`."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


class _NoMetrics:
    def __getattr__(self, name):
        return None

    def inc(self, *args, **kwargs) -> None:
        pass

    def set(self, *args, **kwargs) -> None:
        pass

    def observe(self, *args, **kwargs) -> None:
        pass


def patch_coordinator(monkeypatch):
    """-> make(config, models=None): a Coordinator instance whose workers run in this process
    (models from the config's sources, or given as {"target": module, "draft": module})."""
    import specserve.serve.coordinator as coordinator
    import specserve.serve.workers as workers
    from specserve.engine import DraftModelProposer, TargetVerifier

    models: dict = {}

    def actor(cls, resources, bundle, name):
        def build(*args, **kwargs):
            if not models:
                return LocalActor(cls(*args, **kwargs))
            obj = cls.__new__(cls)
            workers._Worker.__init__(obj, None)
            if issubclass(cls, workers.TargetWorker):
                obj.model = TargetVerifier(models["target"], args[1])
                obj.info_ = workers.ModelInfo(obj.model.vocab_size, None, frozenset())
                obj.proposer = None
            else:
                obj.model = DraftModelProposer(models["draft"], args[1], args[2])
            return LocalActor(obj)

        return type("ActorClass", (), {"remote": staticmethod(build)})

    monkeypatch.setattr(coordinator, "_actor", actor)
    # the stand-ins' results are theirs to give; an object in Ray's store (a worker's q shared
    # through it, where a test has Ray running) is the store's
    real_get = coordinator.ray.get
    monkeypatch.setattr(coordinator.ray, "get", lambda ref, **kw: (
        real_get(ref, **kw) if isinstance(ref, coordinator.ray.ObjectRef) else _value(ref)))
    monkeypatch.setattr(coordinator, "CoordinatorMetrics", lambda name: _NoMetrics())
    monkeypatch.setattr(workers, "_assigned_gpus", lambda: [])

    def make(config: AppConfig, given: dict | None = None):
        models.clear()
        models.update(given or {})
        return coordinator.Coordinator.func_or_class(config)

    return make
