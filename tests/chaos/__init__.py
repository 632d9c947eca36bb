"""The chaos suite: tests that kill a part of a real run mid-way and check the books."""
