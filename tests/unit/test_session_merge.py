from mesh.chat import Message
from services.router.sessions import merge

SYS = Message("system", "Be brief.")
U1, A1, U2 = Message("user", "Hi, I am Ada."), Message("assistant", "Hello Ada."), Message("user", "My name?")


def test_no_history_means_the_request_is_everything() -> None:
    assert merge([], [SYS, U1]) == ([SYS, U1], [SYS, U1])


def test_full_history_resent_is_used_as_is() -> None:
    assert merge([SYS, U1, A1], [SYS, U1, A1, U2]) == ([SYS, U1, A1, U2], [U2])


def test_only_the_new_message_follows_the_history() -> None:
    assert merge([SYS, U1, A1], [U2]) == ([SYS, U1, A1, U2], [U2])


def test_a_repeated_system_prompt_is_not_stacked() -> None:
    assert merge([SYS, U1, A1], [SYS, U2]) == ([SYS, U1, A1, U2], [U2])


def test_a_different_system_message_is_kept_as_new() -> None:
    other = Message("system", "Now answer in French.")
    assert merge([SYS, U1, A1], [other, U2]) == ([SYS, U1, A1, other, U2], [other, U2])
