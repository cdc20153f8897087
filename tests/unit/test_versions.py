import pytest

from mesh.errors import InvalidArgument, NotFound, Unavailable
from services.router.versions import ModelVersions, resolve_model, unit_interval, version_key


def test_natural_version_order() -> None:
    assert sorted(["10", "2", "1.10", "1.9", "1"], key=version_key) == ["1", "1.9", "1.10", "2", "10"]


def test_default_is_lowest_served_until_set() -> None:
    v = ModelVersions()
    assert v.choose("m", {"2", "1"}, key="a") == "1"
    v.set("m", {"1", "2"}, default="2")
    assert all(v.choose("m", {"1", "2"}, key=str(i)) == "2" for i in range(50))


def test_configured_default_wins_over_lowest() -> None:
    v = ModelVersions({"m": "2"})
    assert v.choose("m", {"1", "2"}, key="x") == "2"


def test_pin_must_be_served() -> None:
    v = ModelVersions()
    assert v.choose("m", {"1", "2"}, pinned="2") == "2"
    with pytest.raises(NotFound, match="version '3' of 'm' is not served"):
        v.choose("m", {"1", "2"}, pinned="3")


def test_nothing_served_is_unavailable() -> None:
    with pytest.raises(Unavailable):
        ModelVersions().choose("m", set(), key="k")


def test_canary_share_is_close_and_sticky_per_key() -> None:
    v = ModelVersions()
    v.set("m", {"1", "2"}, default="1", canary={"2": 0.2})
    picks = [v.choose("m", {"1", "2"}, key=f"session-{i}") for i in range(10_000)]
    assert 0.18 < picks.count("2") / len(picks) < 0.22
    # The same key always lands on the same version (a session stays on its version).
    assert all(v.choose("m", {"1", "2"}, key=f"session-{i}") == picks[i] for i in range(200))
    assert all((unit_interval(f"session-{i}") < 0.2) == (picks[i] == "2") for i in range(200))


def test_unhealthy_canary_falls_back_to_default_and_missing_default_to_newest() -> None:
    v = ModelVersions()
    v.set("m", {"1", "2"}, default="1", canary={"2": 1.0})
    assert v.choose("m", {"1", "2"}, key="k") == "2"
    assert v.choose("m", {"1"}, key="k") == "1"
    v.set("m", {"1", "2", "3"}, default="1", canary={})
    assert v.choose("m", {"2", "3"}, key="k") == "3"


def test_set_validates_before_changing_anything() -> None:
    v = ModelVersions()
    v.set("m", {"1", "2"}, default="1", canary={"2": 0.5})
    with pytest.raises(InvalidArgument, match="version '9' of 'm' is not served"):
        v.set("m", {"1", "2"}, default="9")
    with pytest.raises(InvalidArgument, match="canary share"):
        v.set("m", {"1", "2"}, canary={"2": 1.5})
    with pytest.raises(InvalidArgument, match="add up to"):
        v.set("m", {"1", "2", "3"}, canary={"2": 0.6, "3": 0.6})
    with pytest.raises(NotFound):
        v.set("x", set(), default="1")
    routing = v.routing("m", {"1", "2"})
    assert routing.default == "1" and routing.canary == {"2": 0.5}
    v.set("m", {"1", "2"}, default="2", canary={"2": 0.0})
    assert v.routing("m", {"1", "2"}).canary == {}


def test_resolve_model_names_versions_and_the_default() -> None:
    served = ["m", "other"]
    assert resolve_model("", "", "m", served) == ("m", "")
    assert resolve_model("default", "", "m", served) == ("m", "")
    assert resolve_model("other@2", "", "m", served) == ("other", "2")
    assert resolve_model("other", "3", "m", served) == ("other", "3")
    assert resolve_model("other@2", "2", "m", served) == ("other", "2")
    with pytest.raises(InvalidArgument, match="names version '2' but the request pins '3'"):
        resolve_model("other@2", "3", "m", served)
    with pytest.raises(NotFound, match="model 'nope' is not served; available: m, other"):
        resolve_model("nope", "", "m", served)
    with pytest.raises(NotFound, match="available: none yet"):
        resolve_model("", "", "m", [])
