# EAGLE-3 hidden-state pipeline: (regenerate ->) prepare -> extract -> validate -> vocab/train ->
# evaluate -> export -> report. Rules hold wiring only; the logic lives in the eaglepipe package.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


include: "rules/common.smk"


# Regeneration of the assistant turns by the target (dataset.regenerate), before prepare.
if REGENERATE:

    include: "rules/regenerate.smk"


include: "rules/prepare.smk"
include: "rules/extract.smk"
include: "rules/validate.smk"
include: "rules/train.smk"
include: "rules/report.smk"
include: "rules/benchmark.smk"


onstart:
    # Before any job: a plan that cannot fit on the disk (stated at parse time) is refused.
    hooks.refuse_plan_that_cannot_fit(DISK_PLAN, RUN, workflow)
    # Only a run that executes jobs records its config (a dry run never rewrites it).
    hooks.record_run(RUN)
    hooks.warn_about_rerun_triggers(workflow)


onsuccess:
    hooks.stop_server_started_by_this_run()


onerror:
    hooks.stop_server_started_by_this_run()


rule all:
    default_target: True
    input:
        final_targets(),
