"""nbgrader's configuration for the course built from this book (`make assignments`; see course/README.md)."""

c = get_config()  # noqa: F821 (nbgrader provides it)

import os

c.CourseDirectory.root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "course")
c.CourseDirectory.course_id = "marlhf-edu"
# Chapters 07-10 train small models on screen: a cell may run for minutes on a 2-core laptop.
c.Execute.timeout = 900
c.Execute.extra_arguments = ["--IPKernelApp.log_level=ERROR"]
# A graded cell reports case by case; its traceback is the feedback, so keep it whole.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
