"""The report: summary numbers, figures, Markdown and TensorBoard export of a run folder."""
