"""The book's teaching machinery: the exercise framework and checkers, problem sets, the chapters' helpers, diagrams."""
