"""The torch-free contract between estimators and solver: plain numbers, one record per module."""
