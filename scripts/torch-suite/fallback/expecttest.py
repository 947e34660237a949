"""Stand-in for the expecttest package, which torch's test helpers import;
last on a torch-suite run's PYTHONPATH, so an installed expecttest wins.

It compares inline expectations as expecttest does without EXPECTTEST_ACCEPT
(torch's TestCase calls these through super()); it never rewrites a test
file, so a mismatch fails the test."""

import unittest

ACCEPT = False
# What may follow the expected text: the C++ stack trace torch appends to
# some error messages.
CPP_STACK_HEADER = "\nException raised from"


class TestCase(unittest.TestCase):
    def assertExpectedInline(self, actual, expect, skip=0):
        self.assertMultiLineEqualMaybeCppStack(expect, actual, msg="expected text differs (stand-in expecttest)")

    def assertExpectedRaisesInline(self, exc_type, callable, expect, *args, **kwargs):
        with self.assertRaises(exc_type) as caught:
            callable(*args, **kwargs)
        self.assertExpectedInline(str(caught.exception), expect)

    def assertMultiLineEqualMaybeCppStack(self, expect, actual, *args, **kwargs):
        self.assertGreaterEqual(len(actual), len(expect), *args, **kwargs)
        self.assertMultiLineEqual(expect, actual[: len(expect)], *args, **kwargs)
        rest = actual[len(expect):]
        if rest:
            self.assertEqual(rest[: len(CPP_STACK_HEADER)], CPP_STACK_HEADER, *args, **kwargs)
