"""The book's teaching machinery: exercise checkers, problem sets, the chapters' helpers, diagrams."""
