"""A stand-in for `sacct` on a cluster without accounting (our test cluster; docs/ARCHITECTURE.md
§5).

submitit polls `sacct -o JobID,State,NodeList --parsable2 -j ID ...` for job states; without an
accounting database sacct fails and submitit cannot tell a failed job from a running one. This
answers the same question from `scontrol show job` (which keeps finished jobs for MinJobAge),
in sacct's parsable2 format. Only the options submitit uses are understood.
"""

from __future__ import annotations

import subprocess
import sys


def job_rows(job_id: str) -> list[dict[str, str]]:
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    rows = []
    for line in proc.stdout.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "JobId" in fields:
            rows.append(fields)
    return rows


def main(argv: list[str]) -> int:
    ids = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-j"]
    print("JobID|State|NodeList")
    for job_id in ids:
        for row in job_rows(job_id.split("_")[0]):
            name = row["JobId"]
            if row.get("ArrayJobId") and row.get("ArrayTaskId"):
                task = row["ArrayTaskId"]
                name = f"{row['ArrayJobId']}_{task if task.isdigit() else '[' + task + ']'}"
            print(f"{name}|{row.get('JobState', 'UNKNOWN')}|{row.get('NodeList', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
