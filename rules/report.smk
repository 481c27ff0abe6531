def report_figures(wildcards=None):
    return []
