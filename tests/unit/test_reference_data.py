"""The repository's copy of llama.cpp's outputs is the one in shared/reference (when that is beside it)."""
import pytest

from tests.reference_data import DEFAULT_MODEL_REFERENCE, SHARED_REFERENCE, load_reference


def test_the_copy_in_the_repository_is_shared_references():
    shared = SHARED_REFERENCE / DEFAULT_MODEL_REFERENCE.name
    if not shared.is_file():
        pytest.skip(f"{shared} is absent (a bare clone): nothing to compare the repository's copy with")
    assert DEFAULT_MODEL_REFERENCE.read_bytes() == shared.read_bytes()


def test_the_copy_holds_what_the_golden_tests_read():
    ref = load_reference()
    assert len(ref["completions"]) >= 12 and ref["tokenization_cases"]
    assert all({"prompt_token_ids", "generated_token_ids", "top5_per_position"} <= set(c) for c in ref["completions"])
