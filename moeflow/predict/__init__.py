"""Analytic predictions from measured profiles (``moeflow predict``): what a deployment would do,
before running it, from what its baseline did here."""
