"""Answer extraction: `####`, boxed, last number; commas, signs, decimals, `$`."""

import pytest

from kvdistill.evaluate.answers import extract_answer, find_numbers, gold_answer, is_correct, normalize_number

CASES = [
    # (completion, extracted)
    ("12 + 5 = 17.\n#### 17", "17"),
    ("#### 1,234", "1234"),
    ("He pays $1,234.50 total.\n#### $1,234.50", "1234.5"),
    ("#### -5", "-5"),
    ("#### −5", "-5"),  # Unicode minus
    ("#### -$5", "-5"),
    ("#### $-5", "-5"),
    ("#### +7", "7"),
    ("#### 5.00", "5"),
    ("#### 0.50", "0.5"),
    ("#### .5", "0.5"),
    ("#### -0", "0"),
    ("#### 1,000,000", "1000000"),
    ("#### 1000", "1000"),  # no exponent form after normalisation
    ("The answer is 42.", "42"),  # sentence period is not a decimal point
    ("So she has 3 apples and 4 pears, 7 fruits", "7"),
    ("She had 10 - 3 = 7 left.", "7"),  # a binary minus is not a sign
    ("The difference is 5-8 which gives -3", "-3"),
    ("x = 3\n#### 8\n#### 9", "8"),  # the first #### wins (run-on generation)
    ("#### no number here\nbut 12 later\n#### 13", "13"),  # a #### line without a number is skipped
    ("#### the answer is 21 apples", "21"),
    ("Total: $2,500 per month", "2500"),
    ("So the result is \\boxed{36}.", "36"),
    ("\\boxed{1,200} and then 7 more words 9", "1200"),  # boxed beats the last number
    ("It rose 50% to 75%", "75"),
    ("At 3:30 pm", "30"),
    ("12,34 items", "34"),  # bad thousands grouping: two numbers
    ("prices 1,2,3", "3"),
    ("no digits at all", None),
    ("", None),
    ("####", None),
    ("4 * 2.5 = 10.0", "10"),
    ("(-4) + 2 = -2", "-2"),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_extract_answer_table(text, expected):
    assert extract_answer(text) == expected


def test_table_is_large_enough():
    assert len(CASES) >= 25


def test_normalize_and_match():
    assert normalize_number("$1,234.50") == "1234.5"
    assert normalize_number("abc") is None
    assert normalize_number(None) is None
    assert find_numbers("3 apples, 1,000 pears and .25 kg") == ["3", "1000", "0.25"]
    assert is_correct("5", "5.0")
    assert is_correct("1234", "1234")
    assert not is_correct("-5", "5")
    assert not is_correct(None, "5")
    assert not is_correct("5", None)
    # long numbers are exact (no rounding to Decimal's default 28 digits): a runaway 47-digit
    # completion is not the gold answer that shares its first 28 digits
    long = "1" * 47
    assert normalize_number(long) == long and normalize_number(long + ".500") == long + ".5"
    assert not is_correct(long, "1" * 46 + "2")


def test_gold_answer_of_gsm8k_field():
    assert gold_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72") == "72"
    assert gold_answer("a\n#### 1,080") == "1080"
