"""billing"""
