"""capacity"""
